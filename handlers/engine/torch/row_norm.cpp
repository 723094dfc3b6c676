// lmi_rows::rms_norm: torch's own RMSNorm kernel (at::rms_norm) behind an op of our own, which
// inductor cannot see into. A compiled decode step calls it as an eager pass does, instead of
// generating its own reduction (which sums a row's squares in another order), so both give a row
// the same bits (row_norm.py says why that matters).
#include <ATen/core/Tensor.h>
#include <ATen/ops/rms_norm.h>
#include <torch/library.h>

namespace {

at::Tensor rms_norm(const at::Tensor &input, const at::Tensor &weight, double eps) {
    return at::rms_norm(input, {input.size(-1)}, weight, eps);
}

}  // namespace

TORCH_LIBRARY(lmi_rows, m) { m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(lmi_rows, CPU, m) { m.impl("rms_norm", &rms_norm); }

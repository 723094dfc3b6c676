// lmi_graphs.Graph: an AOTInductor package run through torch's own C++ loader, as a TorchScript
// class, whose methods torch calls from Python with the GIL released (graph_runner.py says why).
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>
#include <unordered_map>
#include <vector>

namespace {

struct Graph : torch::CustomClassHolder {
    torch::inductor::AOTIModelPackageLoader loader;

    explicit Graph(const std::string &path) : loader(path) {}

    std::vector<at::Tensor> run(const std::vector<at::Tensor> &inputs) { return loader.run(inputs); }

    std::vector<std::string> call_spec() { return loader.get_call_spec(); }

    // The constants by name; user_managed: the caller keeps the tensors alive (none copied).
    void load_constants(const c10::Dict<std::string, at::Tensor> &constants, bool check_full_update,
                        bool user_managed) {
        std::unordered_map<std::string, at::Tensor> map;
        for (const auto &item : constants) map.emplace(item.key(), item.value());
        loader.load_constants(map, /*use_inactive=*/false, check_full_update, user_managed);
    }
};

}  // namespace

TORCH_LIBRARY(lmi_graphs, m) {
    m.class_<Graph>("Graph")
        .def(torch::init<std::string>())
        .def("run", &Graph::run)
        .def("call_spec", &Graph::call_spec)
        .def("load_constants", &Graph::load_constants);
}

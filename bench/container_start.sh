#!/usr/bin/env bash
# Start time of the CPU image: podman run -> /ping 200, then -> decode graphs ready (lmi_decode_graphs_ready in
# /metrics); compile processes counted; 3 runs. Usage: bench/container_start.sh [IMAGE]
set -u
IMAGE=${1:-lmi-serve:cpu}
for i in 1 2 3; do
  name=lmi-measure-$i; port=$((18080 + i))
  podman rm -f $name >/dev/null 2>&1
  t0=$(date +%s.%N)
  podman run -d --name $name --runtime runc --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 \
    --network host --read-only --tmpfs /tmp -e SAGEMAKER_BIND_TO_PORT=$port $IMAGE serve --grpc-port 0 >/dev/null
  until [ "$(curl -s -o /dev/null -w '%{http_code}' localhost:$port/ping)" = 200 ]; do sleep 0.1; done
  t1=$(date +%s.%N)
  until curl -s localhost:$port/metrics | awk '/^lmi_decode_graphs_ready/{r=$2} /^lmi_decode_graphs_total/{t=$2} END{exit !(t>0 && r==t)}'; do sleep 0.2; done
  t2=$(date +%s.%N)
  compiles=$(podman exec $name python3 -c "import os, pathlib; print(sum(b'decode_step' in p.read_bytes() for p in pathlib.Path('/proc').glob('[0-9]*/cmdline') if p.exists() and p.parent.name != str(os.getpid())))")
  echo "run $i: /ping 200 after $(echo "$t1 - $t0" | bc) s; graphs ready after $(echo "$t2 - $t0" | bc) s; compile processes: $compiles; load: $(cut -d' ' -f1-3 /proc/loadavg)"
  podman logs $name > "${TMPDIR:-/tmp}/lmi-measure-$i.log" 2>&1; grep -E "decode graph|compiling" "${TMPDIR:-/tmp}/lmi-measure-$i.log" | cut -c1-200
  podman rm -f $name >/dev/null
done

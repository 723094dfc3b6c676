"""A follower node of a multi-node vLLM engine (`option.nnodes` > 1, `option.node_rank` > 0):
it runs its share of vLLM's workers, which join the leader's torch.distributed group at
`option.master_addr`, and serves no requests; the leader (node rank 0) is a full server. vLLM's
workers wait for the leader for good once it is gone, so the follower watches the leader's
rendezvous port and ends with status 1 when it stays closed (Kubernetes, or LeaderWorkerSet,
then starts the group again); SIGTERM ends it with 0.

This is what `vllm serve --headless` does, reached through vLLM's own executor so that the same
image and the same settings start every node, as DJL LMI's multi-node containers do."""

from __future__ import annotations

import logging
import signal
import socket
import threading

from vllm.usage.usage_lib import UsageContext
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from handlers.config import Config, ConfigError, with_source_adapters
from handlers.engine.vllm.build import engine_args, model_directory

log = logging.getLogger(__name__)


def run_follower(config: Config) -> int:
    """Run this node's workers until they end (SIGTERM, or the leader going away)."""
    model_dir = model_directory(config)
    args = engine_args(with_source_adapters(config, model_dir), model_dir)
    try:
        vllm_config = args.create_engine_config(UsageContext.OPENAI_API_SERVER, headless=True)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"vLLM refuses its engine arguments: {exc}") from exc
    parallel = vllm_config.parallel_config
    log.info("node %d of %d: running vLLM's workers for the leader at %s:%d; this node serves "
             "no requests", parallel.node_rank, parallel.nnodes, parallel.master_addr,
             parallel.master_port)
    executor = MultiprocExecutor(vllm_config, monitor_workers=False)
    stop, died = threading.Event(), threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    def monitor() -> None:  # returns when a worker ends
        executor.start_worker_monitor(inline=True)
        log.error("a worker of this node ended; stopping")
        died.set()
        stop.set()

    threading.Thread(target=monitor, name="workers", daemon=True).start()
    status = _follow(parallel.master_addr, parallel.master_port, stop)
    executor.shutdown()
    return 1 if died.is_set() else status


LEADER_CHECK_S = 5.0
LEADER_MISSES = 3  # checks in a row the leader's port was closed before the follower gives up


def _follow(host: str, port: int, stop: threading.Event) -> int:
    """Wait for `stop` (0) or for the leader's rendezvous port to stay closed (1)."""
    misses = 0
    while not stop.wait(LEADER_CHECK_S):
        misses = 0 if _open(host, port) else misses + 1
        if misses >= LEADER_MISSES:
            log.error("the leader at %s:%d is gone; stopping this node's workers", host, port)
            return 1
    return 0


def _open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=LEADER_CHECK_S):
            return True
    except OSError:
        return False

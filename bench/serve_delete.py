"""``serve.delete`` of an idle one-replica Serve app with Serve's default drain loop
(``graceful_shutdown_wait_loop_s`` 2 s) against kvnotes' default (``server.router_shutdown_wait_loop_s``),
alternating, on a Ray of its own (shut down at the end). Prints each delete's wall seconds and the load.

    .venv/bin/python -m bench.serve_delete --port 18777 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import time


def main(argv: list[str] | None = None) -> None:
    import ray
    from ray import serve

    from kvruntime.config.server import ServerConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=18777)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    ours = ServerConfig.__dataclass_fields__["router_shutdown_wait_loop_s"].default

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Echo:
        def __call__(self, req) -> str:
            return "ok"

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": a.port})
        for r in range(a.rounds):
            for loop in (2.0, ours):
                serve.run(Echo.options(graceful_shutdown_wait_loop_s=loop).bind(), name="probe", route_prefix="/probe")
                t = time.perf_counter()
                serve.delete("probe")
                print(f"round {r} wait_loop {loop:.2f} s: serve.delete {time.perf_counter() - t:.2f} s "
                      f"(load {os.getloadavg()[0]:.2f})", flush=True)
        serve.shutdown()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()

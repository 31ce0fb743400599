"""Test helper: a receiver in a spawned child process driven through a command queue, and the
NIXL sender/receiver pair built on it (tests/test_nixl_transport.py, tests/test_receive_room_nixl.py).

The child runs ``target(cmds, results)``: it puts one greeting on ``results`` (e.g. its agent name
and metadata), answers each command tuple it takes from ``cmds`` on ``results``, and on
``("stop",)`` stops its transport and answers ``("ok", "stopped")``. The child is joined, and
killed by its PID when it does not exit in time."""
from __future__ import annotations

import multiprocessing as mp
from contextlib import contextmanager


@contextmanager
def spawned_receiver(target, *, start_timeout: float = 120, ask_timeout: float = 120):
    """Start ``target`` in a spawned child; yields ``(greeting, ask)`` where ``ask(*cmd,
    timeout=...)`` sends one command and returns the child's answer. On a clean exit the child is
    asked to stop (and must answer ``("ok", "stopped")``); it is always joined, else killed."""
    ctx = mp.get_context("spawn")
    cmds, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=target, args=(cmds, results), daemon=True)
    proc.start()
    try:
        greeting = results.get(timeout=start_timeout)

        def ask(*cmd, timeout=ask_timeout):
            cmds.put(cmd)
            return results.get(timeout=timeout)

        yield greeting, ask
        assert ask("stop") == ("ok", "stopped")
    finally:
        proc.join(20)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def nixl_pair(target, cfg):
    """Generator for a module fixture: ``target`` greets with ``(agent name, metadata)``; yields
    ``(tx, name, ask)``, ``tx`` a parent-side :class:`NixlTransport` (``cfg``) that knows the
    child's agent; stops ``tx``, then the child."""
    from kvtransport.transfer.nixl_transport import NixlTransport
    with spawned_receiver(target) as ((name, md), ask):
        tx = NixlTransport(cfg)
        tx.add_peer(name, md)
        yield tx, name, ask
        tx.stop()

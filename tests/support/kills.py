"""Killing a child process at its n-th file-system step: the prelude of the kill drivers the tests write.

A driver script starts with ``KILL_PRELUDE``; it reads ``{"kill_at": n, ...}`` as JSON from ``sys.argv[1]`` into
``args``, and every call made through a function it ``wrap``s counts one step (``after=True``: the return too);
the n-th step is a SIGKILL. The driver prints the step names it went through (``tags``), so a test learns how many
steps there are from a run with ``kill_at`` 0.
"""

from __future__ import annotations

KILL_PRELUDE = """
import json, os, signal, sys

args = json.loads(sys.argv[1])
kill_at, tags = args["kill_at"], []

def hit(tag):
    tags.append(tag)
    if len(tags) == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)

def wrap(owner, name, after=False):
    real = getattr(owner, name)
    def wrapper(*a, **k):
        hit(name)
        result = real(*a, **k)
        if after:
            hit(name + ":after")
        return result
    setattr(owner, name, wrapper)
"""

"""``m3-serve``: transformers' own ``transformers serve`` with M3's sparse attention.

transformers' server takes ``--attn-implementation`` as a name it knows or a hub-kernel
string, and a command line cannot ``import m3_hf_attention`` first. So this command does
three things and hands every argument to transformers' CLI unchanged otherwise:

* without ``--attn-implementation`` (or with ``m3_sparse``, or ``paged|m3_sparse``, the name
  continuous batching gives it) it passes this kernel's hub string,
  :data:`HUB_REPO_ID`. transformers loads that through ``kernels``, and the kernel brings the
  whole integration: the paged cache, the mask function and, under ``--continuous-batching``,
  the serving allocator;
* it points ``LOCAL_KERNELS`` at the kernel this package loads (this source tree's ``build/``,
  or the directory ``M3_SPARSE_KERNEL`` names), so the hub string resolves offline to the same
  code as ``import m3_hf_attention``. An ``LOCAL_KERNELS`` already set is left alone, and with
  ``M3_SPARSE_KERNEL`` naming a hub repository the hub string is that repository;
* it imports the package, which registers ``attn_implementation="m3_sparse"`` in the process.

Serving this kernel under ``--continuous-batching`` without ``--cb-max-batch-tokens``, it also
sets that flag to :data:`SERVE_STEP_TOKENS` and says so on stderr. Any other attention is served
with transformers' defaults.

    m3-serve /path/to/m3 --continuous-batching            # the model pinned, localhost:8000
    m3-serve /path/to/m3 --continuous-batching --port 9000 --cb-max-batch-tokens 4096

``m3-serve --help`` prints transformers' options. The server listens on localhost unless
``--host`` says otherwise. ``kill -USR1`` to the server, or to the process that runs its model
(transformers' server spawns one), prints each of that process's threads' Python stacks to
stderr, and it serves on: where a request that makes no progress is waiting.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import sys
from pathlib import Path

from ._kernel import HUB_REPO_ID, kernel_location

ATTN_FLAG = "--attn-implementation"
# The names this package registers in a process, which transformers' server would refuse: the
# command passes the hub string in their place.
OWN_NAMES = ("m3_sparse", "paged|m3_sparse")
STEP_FLAG = "--cb-max-batch-tokens"
# Query tokens of one continuous-batching step, when the command line gives none. A step that
# takes a prefill chunk holds every decoding request in it until the chunk is done, so the step
# size bounds the gaps between a stream's tokens. transformers' own default is sized for
# throughput; at this size the gaps' p99 stayed within a few times their p50 while a 12-layer
# M3 served a steady rate of long prompts, at a small cost in saturated tokens/s (docs/PERF.md,
# issue 51's row).
SERVE_STEP_TOKENS = 2048
# Set by the command for the processes the server spawns: spawning imports this module there
# again (the parent's main module, or the console script's import of it), which registers the
# stack dump of ``kill -USR1`` in the model's process too.
STACKS_ENV = "M3_SERVE_STACKS_ON_SIGUSR1"


def _stacks_on_sigusr1() -> None:
    if hasattr(signal, "SIGUSR1"):  # not on Windows
        faulthandler.register(signal.SIGUSR1, all_threads=True)


if os.environ.get(STACKS_ENV) == "1" and multiprocessing.current_process().name != "MainProcess":
    _stacks_on_sigusr1()


def _kernel_source() -> tuple[str, Path | None]:
    """(the hub string transformers gets, the local kernel directory it resolves to or None):
    the kernel ``import m3_hf_attention`` loads. A hub repository (``org/name``, or
    ``org/name@revision``, which transformers' hub strings take too) is named as it is."""
    local, hub = kernel_location()
    return (hub, None) if hub is not None else (HUB_REPO_ID, local)


def serve_args(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The arguments ``transformers serve`` gets for ``m3-serve argv``, and the environment it adds."""
    hub, local = _kernel_source()
    args = list(argv)
    ours = True  # whether the server runs this kernel's attention
    for i, arg in enumerate(args):
        if arg == ATTN_FLAG:
            if i + 1 >= len(args):
                raise SystemExit(f"m3-serve: {ATTN_FLAG} needs a value")
            if args[i + 1] in OWN_NAMES:
                args[i + 1] = hub
            ours = args[i + 1] == hub
            break
        if arg.startswith(ATTN_FLAG + "="):
            if arg.split("=", 1)[1] in OWN_NAMES:
                args[i] = f"{ATTN_FLAG}={hub}"
            ours = args[i] == f"{ATTN_FLAG}={hub}"
            break
    else:
        args += [ATTN_FLAG, hub]
    if ours and "--continuous-batching" in args and not _has_flag(args, STEP_FLAG):
        args[:0] = [STEP_FLAG, str(SERVE_STEP_TOKENS)]  # first: an added attention flag stays last
    env = {}
    if local is not None and "LOCAL_KERNELS" not in os.environ:
        env["LOCAL_KERNELS"] = f"{HUB_REPO_ID}={local}"
    return args, env


def _has_flag(args: list[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in args)


def main(argv: list[str] | None = None) -> None:
    given = sys.argv[1:] if argv is None else argv
    args, env = serve_args(given)
    if _has_flag(args, STEP_FLAG) and not _has_flag(given, STEP_FLAG):
        print(f"m3-serve: {STEP_FLAG} {SERVE_STEP_TOKENS} (m3-serve's default for this kernel; "
              f"give {STEP_FLAG} to choose another)", file=sys.stderr)
    os.environ.update(env)
    os.environ[STACKS_ENV] = "1"
    _stacks_on_sigusr1()
    import m3_hf_attention  # noqa: F401  (registers m3_sparse in this process)

    try:
        import typer
        from transformers.cli.serve import Serve
    except ImportError as e:  # transformers without its CLI extras
        raise SystemExit(f"m3-serve: transformers' server is not available ({e}); pip install 'm3-hf-attention[serve]'")
    # transformers' own `serve` command, alone in an app: `m3-serve [OPTIONS] MODEL`.
    app = typer.Typer(add_completion=False)
    app.command()(Serve)
    app(args=args, prog_name="m3-serve")


if __name__ == "__main__":
    main()

"""A fake training program, the workload of the runner's unit tests and of Molecule ``launch`` and ``patrol``.

    fake_train.py [--epochs N] [--steps-per-epoch M] [--step-s S] [--out DIR] [--ckpt-kib K]
                  [--crash | --crash-at-epoch E] [--cuda-oom] [--exit CODE] [--signal-self SIG] [--hang] [--forever]
                  [--ignore-sigterm] [--nan] [--fill-disk [--fill-limit-mib N]] [--silent] [--stop-file PATH]
                  [--fork-children N [--child-s S] [--child-term-delay S]] [--record FILE]
                  [--print-env NAME ...] [--show-env NAME ...]

It prints ``epoch i/N step j/M loss x`` lines (the progress patrol reads), writes ``latest.pth`` every epoch and
``best.pth`` when the loss improves (random bytes, ``--ckpt-kib`` each) into ``--out`` (alias ``--ckpt``; default
$RGT_CELL_DIR, else the working directory). Small and fast by default: two epochs of three 10 ms steps.

``--crash`` raises a real exception (a Python traceback) at ``--crash-at-epoch`` (default 1); ``--cuda-oom`` prints,
at the same point, the traceback PyTorch prints when the CUDA allocator runs out of memory
(``torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ...``) and exits 1.

``--silent`` trains (steps, checkpoints) while printing nothing, as frameworks that write only when an epoch or the
whole fit ends. ``--stop-file PATH`` ends the training, as a success, after the step during which PATH appeared
(with ``--forever``: a run that ends when the test says so).

``--print-env`` proves a variable reached the job without writing its value (it may be a secret): it prints the
first 16 hex digits of its sha256. ``--show-env`` prints the value itself (for CUDA_VISIBLE_DEVICES and the like).
``--record`` appends JSON lines ``{event, ts, pid, cell, gpus}`` (start, end, child_exit): the tests' independent
view of when a cell's processes lived. Standard library only: it runs on the fleet's bare system Python.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import math
import os
import random
import signal
import sys
import time
from typing import List, Optional


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps-per-epoch", type=int, default=3)
    parser.add_argument("--step-s", "--sleep", dest="step_s", type=float, default=0.01, help="seconds per step")
    parser.add_argument("--out", "--ckpt", dest="out", default=None, help="checkpoint directory")
    parser.add_argument("--ckpt-kib", type=int, default=4)
    parser.add_argument("--crash", action="store_true", help="a Python traceback at --crash-at-epoch (default 1)")
    parser.add_argument("--crash-at-epoch", type=int, default=None)
    parser.add_argument("--cuda-oom", action="store_true", help="a CUDA out-of-memory traceback at --crash-at-epoch")
    parser.add_argument("--exit", dest="exit_code", type=int, default=0, help="exit status after training")
    parser.add_argument("--signal-self", type=int, default=None, help="die by this signal after training")
    parser.add_argument("--hang", action="store_true", help="stop printing after the first step and sleep")
    parser.add_argument("--forever", action="store_true", help="train forever")
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--nan", action="store_true", help="print a NaN loss")
    parser.add_argument("--silent", action="store_true", help="train while printing nothing")
    parser.add_argument("--stop-file", default=None, help="end the training once this file exists")
    parser.add_argument("--fill-disk", action="store_true", help="save until the disk is full (ENOSPC)")
    parser.add_argument("--fill-limit-mib", type=int, default=None, help="simulate ENOSPC after this many MiB")
    parser.add_argument("--fork-children", type=int, default=0, help="children that outlive the program")
    parser.add_argument("--child-s", type=float, default=30.0, help="how long each child lives")
    parser.add_argument("--child-term-delay", type=float, default=0.0, help="seconds a child takes to die on TERM")
    parser.add_argument("--record", default=None, help="append JSON event lines to this file")
    parser.add_argument("--print-env", nargs="+", default=[], metavar="NAME")
    parser.add_argument("--show-env", nargs="+", default=[], metavar="NAME")
    return parser.parse_args(argv)


def _record(path: Optional[str], event: str) -> None:
    if not path:
        return
    line = json.dumps(
        {
            "event": event,
            "ts": time.time(),
            "pid": os.getpid(),
            "cell": os.environ.get("RGT_CELL"),
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
    )
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _child(args: argparse.Namespace, index: int, ready: int) -> None:
    """A worker left behind: every second one leaves the session (as some launchers' daemons do)."""
    if index % 2 == 1:
        os.setsid()

    def on_term(signum: int, frame: object) -> None:
        time.sleep(args.child_term_delay)
        _record(args.record, "child_exit")
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    os.write(ready, b".")  # only now may the program end: a SIGTERM before this would leave no record
    os.close(ready)
    time.sleep(args.child_s)
    _record(args.record, "child_exit")
    os._exit(0)


def _fork_children(args: argparse.Namespace) -> None:
    for index in range(args.fork_children):
        sys.stdout.flush()
        ready_read, ready_write = os.pipe()
        if os.fork() == 0:
            try:
                os.close(ready_read)
                _child(args, index, ready_write)
            finally:
                os._exit(0)
        os.close(ready_write)
        os.read(ready_read, 1)  # the child has left the session if it is to, and handles SIGTERM
        os.close(ready_read)


def _save(directory: str, name: str, kib: int) -> None:
    path = os.path.join(directory, name)
    temporary = f"{path}.tmp"
    with open(temporary, "wb") as handle:
        handle.write(os.urandom(kib * 1024))
    os.replace(temporary, path)


def _fill_disk(directory: str, limit_mib: Optional[int]) -> None:
    chunk = os.urandom(1024 * 1024)
    written = 0
    with open(os.path.join(directory, "fill.bin"), "wb") as handle:
        while True:
            if limit_mib is not None and written >= limit_mib:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), handle.name)
            handle.write(chunk)
            handle.flush()
            written += 1


# What PyTorch 2.x prints when the caching allocator cannot satisfy a request (the frames are a typical
# training script's; the message is torch's own wording).
CUDA_OOM_TRACEBACK = """Traceback (most recent call last):
  File "/root/code/train.py", line 214, in <module>
    main()
  File "/root/code/train.py", line 189, in main
    outputs = model(**batch)
              ^^^^^^^^^^^^^^
  File "/usr/local/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1532, in _wrapped_call_impl
    return self._call_impl(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/usr/local/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1541, in _call_impl
    return forward_call(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/root/code/model.py", line 88, in forward
    attn = torch.softmax(q @ k.transpose(-2, -1) * self.scale, dim=-1)
                         ~~^~~~~~~~~~~~~~~~~~~~~
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB \
of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.03 GiB memory in use. Of the allocated \
memory 75.12 GiB is allocated by PyTorch, and 1.41 GiB is reserved by PyTorch but unallocated. If reserved but \
unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  \
See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)
"""


def _show_environment(args: argparse.Namespace) -> None:
    for name in args.print_env:
        value = os.environ.get(name)
        proof = "unset" if value is None else "sha256=" + hashlib.sha256(value.encode()).hexdigest()[:16]
        print(f"env {name} {proof}")
    for name in args.show_env:
        print(f"env {name}={os.environ.get(name, '<unset>')}")


def main(argv: Optional[List[str]] = None) -> int:
    args = _parse(argv)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = args.out or os.environ.get("RGT_CELL_DIR") or os.getcwd()
    os.makedirs(out, exist_ok=True)
    _record(args.record, "start")
    _show_environment(args)
    _fork_children(args)
    crash_at = args.crash_at_epoch if args.crash_at_epoch is not None else (1 if args.crash or args.cuda_oom else None)
    best = math.inf
    epoch = 0
    while args.forever or epoch < args.epochs:
        epoch += 1
        if crash_at is not None and epoch >= crash_at and args.cuda_oom:
            sys.stdout.flush()
            sys.stderr.write(CUDA_OOM_TRACEBACK)
            sys.stderr.flush()
            return 1
        if crash_at is not None and epoch >= crash_at:
            raise RuntimeError(f"fake_train: crashed at epoch {epoch} as asked")
        for step in range(1, args.steps_per_epoch + 1):
            loss = float("nan") if args.nan else 1.0 / (epoch * args.steps_per_epoch + step) + random.random() * 1e-3
            total = "inf" if args.forever else str(args.epochs)
            if not args.silent:
                print(f"epoch {epoch}/{total} step {step}/{args.steps_per_epoch} loss {loss:.4f}", flush=True)
            if args.hang:
                while True:
                    time.sleep(3600)
            time.sleep(args.step_s)
            if args.stop_file and os.path.exists(args.stop_file):
                break
        if args.fill_disk:
            _fill_disk(out, args.fill_limit_mib)
        _save(out, "latest.pth", args.ckpt_kib)
        if epoch == 1 or loss < best:  # a NaN loss never improves on the first epoch's checkpoint
            best = loss
            _save(out, "best.pth", args.ckpt_kib)
        if args.stop_file and os.path.exists(args.stop_file):
            break  # the epoch was cut short at the step the file appeared; its checkpoints are saved
    _record(args.record, "end")
    sys.stdout.flush()
    if args.signal_self is not None:
        os.kill(os.getpid(), args.signal_self)
        time.sleep(5)
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())

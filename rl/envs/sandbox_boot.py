"""The first code a sandboxed Python runs (``python -I sandbox_boot.py '<json>'``): move
into its private root, restrict itself with Landlock, filter its system calls with
seccomp, then run the user's ``main.py`` in its own directory.

Run by path with ``-I``, so nothing from the job's environment or working directory is
imported; it loads private_root.py, landlock.py and seccomp.py beside it by path, for the
same reason, and before the private root hides this directory.
"""

import importlib.util
import json
import os
import runpy
import sys
import traceback
from pathlib import Path
from types import ModuleType

PRIVATE_ROOT_REFUSED = 96  # the exit status when the private root was wanted and failed
LANDLOCK_REFUSED = 97  # the exit status when Landlock was wanted and the kernel refused it
SECCOMP_REFUSED = 98  # the exit status when the seccomp filter was wanted and refused


def _load(name: str) -> ModuleType:
    where = Path(__file__).with_name(f"{name}.py")
    module_spec = importlib.util.spec_from_file_location(f"_sandbox_{name}", where)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def main() -> None:
    spec = json.loads(sys.argv[1])
    workdir = spec["workdir"]
    landlock = _load("landlock") if spec["landlock"] else None
    seccomp = _load("seccomp") if spec.get("seccomp") else None
    if spec.get("root"):
        try:
            _load("private_root").enter(spec["root"], spec["read"], workdir, ["/dev/null"])
        except Exception as e:  # whatever it was, the code does not run with the host in view
            print(f"sandbox: no private root: {e}", file=sys.stderr)
            sys.exit(PRIVATE_ROOT_REFUSED)
    if landlock is not None:
        try:
            landlock.restrict(spec["read"], [workdir], ["/dev/null"])
        except OSError as e:
            print(f"sandbox: Landlock refused: {e}", file=sys.stderr)
            sys.exit(LANDLOCK_REFUSED)
    if seccomp is not None:  # last: the mounts and the pivot above are calls it denies
        try:
            seccomp.install()
        except OSError as e:
            print(f"sandbox: seccomp refused: {e}", file=sys.stderr)
            sys.exit(SECCOMP_REFUSED)
    os.chdir(workdir)
    # Under `unshare --pid` this process is the namespace's init, which ignores signals it
    # has no handler for, SIGXCPU included: the code runs in a child, and init waits.
    pid = os.fork() if os.getpid() == 1 else 0
    if pid:
        status = os.waitpid(pid, 0)[1]
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
        os._exit(128 + sig if sig else os.WEXITSTATUS(status))
    sys.argv = ["main.py"]
    sys.path.insert(0, workdir)
    try:
        runpy.run_path("main.py", run_name="__main__")
    except SystemExit:
        raise
    except BaseException as e:  # the user's traceback, without this file's frames
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "main.py":
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        sys.exit(1)


if __name__ == "__main__":
    main()

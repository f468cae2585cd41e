"""What a recorded run of the test suite covered: which test files it ran whole, and which runs
of one `engine/` tree were parts of one run. Read by `harness suite --check` and by the README's
generated sentence, so it imports nothing of the engine (the table and figure jobs do not)."""

# The files whose tests run the engine on the device (exactness at every install and architecture,
# the kernels, the installs, the server): a GPU run of these (`--gpu-files`) is what says an
# `engine/` tree is exact on CUDA. The rest test the harness, the workflow and the CLI's text,
# which the CPU's CI covers; on a GPU they add minutes and nothing the device decides.
GPU_FILES = tuple(
    f"tests/test_{name}.py"
    for name in ("exactness", "devicemap", "staging", "device", "kernels", "use", "slots", "serve", "threads",
                 "trained", "prefetch", "architectures", "store", "options", "registry", "layout")
)  # fmt: skip


def files_of(pytest_args: list) -> frozenset:
    """The test files a run given `pytest_args` ran every test of: every GPU file for the whole
    suite, none where it picked tests out (`-k`, `-m`, `--deselect`, `FILE::TEST`)."""
    if any(a.split("=")[0] in ("-k", "-m", "--deselect") or "::" in a for a in pytest_args):
        return frozenset()
    paths = {a.rstrip("/") for a in pytest_args if not a.startswith("-")}
    return frozenset(GPU_FILES) if not paths or "tests" in paths else frozenset(paths)


def covers_gpu_files(pytest_args: list) -> bool:
    """Whether a run given `pytest_args` ran every test of GPU_FILES: the whole suite or every one
    of those files, with no test picked out of them."""
    return set(GPU_FILES) <= files_of(pytest_args)


def split_run(runs: list) -> list:
    """Of runs in the order they ran, each (engine tree, the files it ran whole), the indices of the
    latest and of those just before it that ran other files of the same tree: a suite split in parts
    where device time is short (scripts/device_gpu.sh's tests and tests2), which count as one run."""
    tree, seen = runs[-1][0], set(runs[-1][1])
    parts = [len(runs) - 1]
    for i in range(len(runs) - 2, -1, -1):
        t, files = runs[i]
        if t != tree or not files or files & seen:
            break
        parts.insert(0, i)
        seen |= files
    return parts

"""The library's shape: `engine` never imports the experiments (`harness`), its modules import
each other without a cycle, and it reads no file from outside its own package."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import ROOT

from harness.report import tables

ENGINE = ROOT / "engine"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path) -> list:
    """(module imported, line, inside a function?) for every import statement of a file."""
    tree = ast.parse(path.read_text())
    pkg = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    out = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = pkg.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module
                out.append((mod, child.lineno, in_function))
                out.extend((f"{mod}.{a.name}", child.lineno, in_function) for a in child.names)
            visit(child, nested)

    visit(tree, False)
    return out


FILES = sorted(ENGINE.rglob("*.py"))
MODULES = {module_name(f): f for f in FILES}


def test_the_library_never_imports_the_experiments():
    for f in FILES:
        for mod, line, _ in imports(f):
            assert not mod.split(".")[0] == "harness", f"{f.relative_to(ROOT)}:{line} imports {mod}"


def test_no_import_cycle_inside_the_library():
    graph = {m: set() for m in MODULES}
    for m, f in MODULES.items():
        for mod, _, _ in imports(f):
            if mod in MODULES and mod != m and not mod.endswith("__main__"):
                graph[m].add(mod)
    # A package's __init__ re-exporting its children is not a cycle of the children's code.
    for m in list(graph):
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".")}
    seen, stack = {}, []

    def dfs(m):
        seen[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if seen.get(d) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d) :] + [d]))
            if d not in seen:
                dfs(d)
        seen[m] = "done"
        stack.pop()

    for m in sorted(graph):
        if m not in seen:
            dfs(m)


# Where a module imports inside a function, and why it must (optional or GPU-only, or the
# command's own late dispatch): anything else belongs at the top of the module.
ALLOWED_LATE = {}


def test_imports_are_at_the_top_of_modules():
    late = []
    for f in FILES:
        rel = str(f.relative_to(ROOT))
        for mod, line, in_function in imports(f):
            if in_function and rel not in ALLOWED_LATE:
                late.append(f"{rel}:{line} {mod}")
    assert not late, late


def test_the_library_reads_no_file_outside_its_package():
    for f in FILES:
        text = f.read_text()
        for needle in ("REPO_ROOT", 'configs/models.yaml")', "workflow/schemas", "results/raw"):
            assert needle not in text, f"{f.relative_to(ROOT)} mentions {needle}"


# The library's floors, from the ground up: a module imports only from its own floor or below.
# Prediction sits on two: the predictors the runtime asks stay below it; tracing, fitting and
# replay (which decode through the runtime) above it.
FLOORS = (
    ("engine.config", "engine.cudart", "engine.device", "engine.versions"),
    ("engine.predict",),
    ("engine.models",),
    ("engine.runtime",),
    ("engine.tracing",),
)  # every other module of engine/ (the public face, the command line, the server, cluster) above


def floor_of(module: str) -> int:
    for i, prefixes in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return len(FLOORS)


def test_nothing_below_the_runtime_imports_what_is_above_it():
    packages = {m for m, f in MODULES.items() if f.name == "__init__.py"}
    up = []
    for m, f in MODULES.items():
        if f.name == "__init__.py":
            continue  # a package's face re-exports what is below it
        for mod, line, _ in imports(f):
            if mod in MODULES and mod not in packages and floor_of(mod) > floor_of(m):
                up.append(f"{f.relative_to(ROOT)}:{line} imports {mod}")
    assert not up, up


def test_the_decode_path_never_reaches_tracing_or_fitting():
    """One direction: the runtime is handed a predictor; tracing and fitting (which run the model
    through the runtime) are above it."""
    for f in sorted((ENGINE / "runtime").glob("*.py")):
        for mod, line, _ in imports(f):
            assert not mod.startswith(("engine.tracing", "engine.api")), f"{f.relative_to(ROOT)}:{line} imports {mod}"


def _counter_writes():
    """(file, line, class) of every write of a StepStats counter in the library: an assignment to
    `<...>.stats.<field>` or to `st.<field>` (the caches' local name for their stats)."""
    from engine.runtime.moe import StepStats

    counters = set(StepStats.__dataclass_fields__)
    out = []
    for f in FILES:
        tree = ast.parse(f.read_text())

        def visit(node, cls, f=f):
            for child in ast.iter_child_nodes(node):
                inner = child.name if isinstance(child, ast.ClassDef) else cls
                targets = []
                if isinstance(child, ast.AugAssign):
                    targets = [child.target]
                elif isinstance(child, ast.Assign):
                    targets = child.targets
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr in counters:
                        base = ast.unparse(t.value)
                        if base == "st" or base.endswith("stats"):
                            out.append((f.relative_to(ROOT), child.lineno, cls))
                visit(child, inner, f)

        visit(tree, None)
    return out


def test_the_cache_is_the_only_writer_of_its_counters():
    """The install and the prefetcher return their timings; the layer's switch reports its waits
    through the cache's methods: only the caches write a token's counters."""
    writes = _counter_writes()
    assert writes, "the scan finds the caches' own writes"
    assert {cls for _, _, cls in writes} <= {"ExpertCache", "DeviceCache"}, writes


INSTALL_NAMES = {"inplace", "copy", "pinned", "device"}


def _install_name_branches(path: Path) -> list:
    """Lines of `path` that compare something with an install's name, or ask an install object
    its name in a comparison."""
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if not isinstance(n, ast.Compare):
            continue
        operands = [n.left, *n.comparators]
        named = any(isinstance(o, ast.Constant) and o.value in INSTALL_NAMES for o in operands)
        asked = any(isinstance(o, ast.Attribute) and o.attr == "name" and "install" in ast.unparse(o) for o in operands)
        if named or asked:
            out.append(f"{path.relative_to(ROOT)}:{n.lineno} {ast.unparse(n)}")
    return out


def test_no_code_branches_on_an_installs_name_outside_the_installs():
    """The install is an object chosen once (engine.runtime.installs.choose); the engine, its
    command line and the experiments ask it (its cache, its memory, its name for records), and
    never steer by its name."""
    mine = ENGINE / "runtime" / "installs.py"
    files = [f for f in FILES if f != mine] + sorted((ROOT / "harness").rglob("*.py"))
    branches = [b for f in files for b in _install_name_branches(f)]
    assert not branches, branches
    assert _install_name_branches(mine), "the scan finds the one place that chooses"


PREDICTOR_CLASSES = {"Predictor", "NoPredictor", "Popularity", "Previous", "Transition", "Probe", "Oracle"}


def test_the_runtime_asks_a_predictor_rather_than_checking_its_type():
    """A predictor carries its own behaviour (its host prediction, its device-side prediction,
    whether it takes a run's trace): nothing under engine/runtime/ checks which class it is."""
    found = []
    for f in sorted((ENGINE / "runtime").rglob("*.py")):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Call) and ast.unparse(n.func) in ("isinstance", "type", "issubclass"):
                if any(c in ast.unparse(n) for c in PREDICTOR_CLASSES):
                    found.append(f"{f.relative_to(ROOT)}:{n.lineno} {ast.unparse(n)}")
    assert not found, found


DEVICE_PACKAGE = ENGINE / "runtime" / "device"


def test_the_device_install_is_a_package_of_small_files():
    """engine/runtime/device/: the map state, the operations, the kernels' source and launches, the
    cache, its stats, its prefetch and the host tier, each file at most 300 lines."""
    sizes = {f.name: len(f.read_text().splitlines()) for f in DEVICE_PACKAGE.glob("*.py")}
    assert {"state.py", "ops.py", "kernels.py", "kernel_source.py", "cache.py", "hosttier.py"} <= set(sizes)
    assert all(n <= 300 for n in sizes.values()), sizes


def test_the_cuda_runtime_is_reached_through_engine_device_only():
    """engine/cudart.py (the ctypes binding) is imported by engine/device.py alone; everything
    else, the harness included, asks engine.device."""
    found = []
    for f in FILES + sorted((ROOT / "harness").rglob("*.py")):
        if f == ENGINE / "device.py":
            continue
        for mod, line, _ in imports(f):
            if mod == "engine.cudart" or mod.startswith("engine.cudart."):
                found.append(f"{f.relative_to(ROOT)}:{line}")
    assert not found, found


# What the experiments may use of the engine: its public face and these internals, documented in
# docs/engine.md ("What the harness uses").
HARNESS_MAY_USE = (
    "engine",
    "engine.api",
    "engine.arguments",
    "engine.config",
    "engine.device",
    "engine.memory",
    "engine.versions",
    "engine.models.registry",
    "engine.models.train",
    "engine.models.anatomy",
    "engine.predict",
    "engine.tracing",
    "engine.cluster",
    "engine.runtime.engine",
    "engine.runtime.installs",
    "engine.runtime.loop",
    "engine.runtime.moe",
    "engine.runtime.slots",
    "engine.runtime.store",
)


def test_the_harness_uses_the_engines_face_and_its_documented_internals():
    found = []
    for f in sorted((ROOT / "harness").rglob("*.py")):
        for mod, line, _ in imports(f):
            if mod.split(".")[0] != "engine":
                continue
            if any(m.startswith(mod + ".") for m in HARNESS_MAY_USE):
                continue  # a package a name is imported from (`from engine.models import registry`)
            base = next((m for m in sorted(HARNESS_MAY_USE, key=len, reverse=True)
                         if mod == m or mod.startswith(m + ".")), None)  # fmt: skip
            if base is None or (base == "engine" and mod in MODULES and mod != "engine"):
                found.append(f"{f.relative_to(ROOT)}:{line} {mod}")
    assert not found, found
    doc = (ROOT / "docs" / "engine.md").read_text()
    assert all(f"`{m}`" in doc for m in HARNESS_MAY_USE if m != "engine"), "docs/engine.md names each"


def test_the_workflow_reaches_the_engine_through_the_harness():
    """The rules and their scripts import `harness` only; the harness imports the engine."""
    found = []
    for f in (
        sorted((ROOT / "workflow").rglob("*.py")) + sorted((ROOT / "workflow").rglob("*.smk")) + [ROOT / "Snakefile"]
    ):
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if re.match(r"\s*(from|import) engine\b", line):
                found.append(f"{f.relative_to(ROOT)}:{n}")
    assert not found, found


def test_the_experiments_never_import_the_engines_command_line():
    """The argument types and the errors a command reports are engine.arguments, which both
    command lines use; engine.cli is a front door, not a library."""
    found = []
    for f in sorted((ROOT / "harness").rglob("*.py")) + sorted((ROOT / "workflow").rglob("*.py")):
        for mod, line, _ in imports(f):
            if mod == "engine.cli" or mod.startswith("engine.cli."):
                found.append(f"{f.relative_to(ROOT)}:{line}")
    assert not found, found


def test_one_module_uses_a_private_mlx_lm_function():
    """Where mlx-lm has a public function the engine uses it; models/anatomy.py says why its one
    private call (`_get_classes`) has none."""
    private = []
    for f in FILES:
        for mod, _line, _ in imports(f):
            if mod.startswith("mlx_lm") and mod.rsplit(".", 1)[-1].startswith("_"):
                private.append((str(f.relative_to(ROOT)), mod))
    assert private == [("engine/models/anatomy.py", "mlx_lm.utils._get_classes")], private


def test_the_workflow_imports_the_installed_packages():
    """The rules' scripts and the Snakefile's modules import `engine` and `harness` as installed;
    none patches `sys.path` (the table and figure layer is the package harness.report)."""
    workflow = ROOT / "workflow"
    patched = [
        str(f.relative_to(ROOT))
        for f in sorted(workflow.rglob("*.py")) + sorted(workflow.rglob("*.smk")) + [ROOT / "Snakefile"]
        if "sys.path" in f.read_text()
    ]
    assert not patched, patched


def test_the_rules_environment_is_pinned_by_the_lock():
    """`--use-conda` builds the rules' environment from the project with requirements.lock as
    its constraints: the versions CI runs, not whatever is newest that day."""
    env = ROOT / "workflow" / "envs" / "titan.yaml"
    pip = next(d["pip"] for d in yaml.safe_load(env.read_text())["dependencies"] if isinstance(d, dict))
    constraint = next(line.split(None, 1)[1] for line in pip if line.startswith("-c "))
    lock = (env.parent / constraint).resolve()
    assert lock == ROOT / "requirements.lock" and "mlx-lm==" in lock.read_text()
    assert "-e ../.." in pip


def test_the_text_corpus_is_read_in_one_place():
    """The tokenizers, the training data and the prompt sets all come from engine.predict.corpus
    (the help topics and the standard library's sources), so a prompt's source name means the
    same text everywhere and training can leave out every evaluation prompt's source."""
    readers = [
        str(f.relative_to(ROOT))
        for f in FILES
        if any(mod.startswith(("pydoc_data", "sysconfig")) for mod, _, _ in imports(f))
    ]
    assert readers == ["engine/predict/corpus.py"], readers


def test_the_table_and_figure_jobs_import_no_engine():
    """Tables read raw records and figures read tables: the `tables` and `plots` jobs' modules
    import neither the engine nor MLX (records.py reads what rawlog.py's provenance stamped; the
    workflow tells the plots which models are trained), so `snakemake figures` costs what pandas
    and matplotlib cost."""
    code = (
        "import sys, harness.report.plotting, harness.report.joblog, harness.report.aggregate, "
        "harness.report.docblocks, harness.report.compare_runs; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('engine', 'mlx', 'mlx_lm')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def test_each_table_has_a_module_and_the_workflow_writes_them_all():
    """One module a gate or kind of record under harness/report/tables/; `tables.TABLES` names
    every table the workflow declares (common.smk's TABLES), the claims table made from the rest."""
    smk = (ROOT / "workflow" / "rules" / "common.smk").read_text()
    declared = re.search(r"^TABLES = \[(.*?)\]", smk, re.S | re.M).group(1)
    assert [*tables.TABLES, "claims"] == re.findall(r'"([a-z_]+)"', declared)
    homes = {name: table.__module__ for name, (_, table) in tables.TABLES.items()}
    assert all(m.startswith("harness.report.tables.") for m in homes.values()), homes
    aggregate = ROOT / "harness" / "report" / "aggregate.py"
    assert not [n for n in ast.parse(aggregate.read_text()).body if isinstance(n, ast.FunctionDef)
                and n.name.endswith("_table")]  # fmt: skip

"""The ``fedlt`` command line, run as a user runs it: in subprocesses.

Each bad input must end with exit code 2 and exactly one stderr line ``fedlt: error: ...`` that
names the problem and its fix, with no traceback and no run directory left behind.

Every ``python -m fedlt.cli`` spends ~2 s of CPU importing torch, too much for ~20 invocations
on a small shared machine. So the bad inputs run through :data:`FORK_DRIVER`: one subprocess
imports torch and fedlt's package once, then forks one child per invocation that runs
``fedlt.cli`` as ``__main__`` exactly like ``-m`` does, with its own cwd, stdout/stderr files
and exit status; ``--help`` and the listings go the same way. One bad input also runs as a plain
``python -m fedlt.cli`` to show the two agree, and the successful run and ``fedlt table`` are
plain subprocesses as well.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fedlt.config import load_config
from fedlt.models import create_model

SRC = Path(__file__).resolve().parents[1] / "src"
SYN = ["data.dataset=synthetic"]
LISTINGS = {"help": ["--help"], "run_help": ["run", "--help"], "bench_speed_help": ["bench", "speed", "--help"],
            "no_args_help": [], "bench_no_args_help": ["bench"],
            "table_help": ["table", "--help"], "methods": ["methods"], "datasets": ["datasets"], "models": ["models"],
            "fedyoyo_knobs": ["methods", "fedyoyo"], "fedavg_knobs": ["methods", "fedavg"]}
TINY_RUN = [*SYN, "data.num_clients=10", "fl.rounds=2", "fl.local_epochs=1", "eval.every=1", "--quiet"]


class Payload:
    """What a hostile checkpoint.pt carries: unpickling it creates the file ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


#: two ways to write one: torch's zip format and a bare pickle
MALICIOUS = {"malicious-checkpoint": torch.save,
             "malicious-pickle": lambda obj, path: path.write_bytes(pickle.dumps(obj))}

FORK_DRIVER = r"""
import json, os, runpy, sys, traceback
import fedlt, fedlt.api, typer  # the slow imports, paid once; fedlt.cli itself is left to each child

def child(job):
    os.chdir(job["cwd"])
    module = job.get("module", "fedlt.cli")
    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(job[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = [sys.executable, *job["args"]]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:  # what the interpreter does with it at exit
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

jobs = json.loads(sys.argv[1])
sys.stdout.flush()
sys.stderr.flush()
pids = {}
for name, job in jobs.items():
    pid = os.fork()
    if pid == 0:
        child(job)
    pids[pid] = name
codes = {}
while pids:
    pid, status = os.wait()
    codes[pids.pop(pid)] = os.waitstatus_to_exitcode(status)
print(json.dumps(codes))
"""


def cli_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FEDLT_DATA", "PYTHONPATH")}
    env.update(PYTHONPATH=str(SRC), FLWR_TELEMETRY_ENABLED="0", FEDLT_CACHE=str(tmp / "cache"))
    return env


def fedlt_cli(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedlt.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


class Result:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


class Case:
    """One bad invocation: its arguments and the fragments its error line must contain."""

    def __init__(self, args: list[str], *fragments: str, out_dir: bool = True) -> None:
        self.args, self.fragments, self.out_dir = args, fragments, out_dir


def error_cases(data: Path) -> dict[str, Case]:
    """``data`` holds the prepared folders: empty/, fmnist-garbage/, not-a-run/, cut-off-run/, cut-config/."""
    return {
        "unknown_method": Case(["run", "method=nosuch", *SYN], "'nosuch'", "method=", "fedavg, fedprox, centralized"),
        "unknown_dataset": Case(["run", "data.dataset=nosuch"], "'nosuch'", "data.dataset", "synthetic"),
        "unknown_model": Case(["run", "model.name=nosuch", *SYN], "'nosuch'", "model.name=", "cnn"),
        "unknown_loss": Case(["run", "loss.name=nosuch", *SYN], "'nosuch'", "loss.name=", "ce, la"),
        "imbalance_below_one": Case(["run", "data.imbalance_factor=0.5", *SYN], "data.imbalance_factor", "0.5",
                                    ">= 1"),
        "alpha_zero": Case(["run", "data.alpha=0", *SYN], "data.alpha", "> 0"),
        "participation_above_one": Case(["run", "fl.participation=1.5", *SYN], "fl.participation", "1.5", "(0, 1]"),
        "more_clients_than_samples": Case(["run", *SYN, "data.num_clients=100000"], "data.num_clients=100000",
                                          "fewer clients"),
        "missing_data_files": Case(["run", "data.dataset=cifar10", f"data.root={data / 'empty'}"], "cifar10",
                                   str(data / "empty"), "data_batch_1", "data.root="),
        "missing_data_files_via_data_root_flag": Case(["run", "data.dataset=cifar10", "--data-root", str(data / "empty")],
                                                      "cifar10", str(data / "empty"), "data_batch_1"),
        "corrupt_data_file": Case(["run", "data.dataset=fmnist", f"data.root={data / 'fmnist-garbage'}"], "fmnist",
                                  str(data / "fmnist-garbage" / "train-images-idx3-ubyte"), "re-download"),
        "unknown_key": Case(["run", "data.alphaa=1", *SYN], "'data.alphaa'", "valid keys", "alpha"),
        "unknown_method_knob": Case(["run", "method=fedprox", "method_args.foo=1", *SYN], "method_args.foo",
                                    "knobs: mu"),
        "impossible_min_client_size": Case(["run", "data.min_client_size=100000", *SYN],
                                           "data.min_client_size=100000", "use a data.min_client_size well below"),
        "few_above_many_threshold": Case(["run", "eval.many_threshold=100", *SYN], "eval.few_threshold=200",
                                         "eval.many_threshold=100", "set eval.few_threshold <="),
        "vectorized_unsupported_method": Case(["run", "method=feddecorr", "run.backend=vectorized", *SYN],
                                              "run.backend=vectorized", "feddecorr", "run.backend=auto"),
        "vectorized_loss_of_the_model": Case(["run", "method=sfd", "run.backend=vectorized", *SYN],
                                             "run.backend=vectorized", "sfd", "its loss reads the features",
                                             "run.backend=graphed"),
        "vectorized_under_flower": Case(["run", "engine=flower", "run.backend=vectorized", *SYN],
                                        "run.backend=vectorized", "engine=flower", "run.backend=auto"),
        "parallel_under_flower": Case(["run", "engine=flower", "run.backend=parallel", *SYN],
                                      "run.backend=parallel", "engine=flower", "run.backend=auto"),
        "zero_workers": Case(["run", "run.workers=0", *SYN], "run.workers", "greater than or equal to 1"),
        "secagg_unsupported_method": Case(["run", "method=scaffold", "secagg.enabled=true", *SYN], "secagg.enabled",
                                          "scaffold", "reads each client's fit reply", "secagg.enabled=false"),
        "secagg_calibration_reads_replies": Case(["run", "method=fedavg", "calibration=creff", "secagg.enabled=true",
                                                  "data.num_clients=6", "fl.participation=0.5", *SYN],
                                                 "calibration=creff reads each client's fit reply",
                                                 "drop creff from calibration", "secagg.enabled=false"),
        "wrong_type_value": Case(["run", "fl.rounds=abc", *SYN], "fl.rounds", "give a whole number, e.g. fl.rounds=50"),
        "cut_short_run_config": Case(["run", "--resume", str(data / "cut-config")],
                                     f"{data / 'cut-config' / 'config.yaml'}: invalid config value loss", out_dir=False),
        "secagg_even_neighbours": Case(["run", "secagg.enabled=true", "secagg.neighbours=4", *SYN],
                                       "secagg.neighbours", "odd number >= 3"),
        "override_without_equals": Case(["run", *SYN, "fl.rounds"], "'fl.rounds'", "key=value"),
        "config_is_a_folder": Case(["run", str(data / "empty"), *SYN], f"config file {data / 'empty'} is a folder",
                                   "pass a YAML file"),
        "missing_config_file": Case(["run", str(data / "nope.yaml"), *SYN], str(data / "nope.yaml"), "does not exist"),
        # a line break in a name it quotes keeps the error on one line, shown as its escape
        "config_name_with_a_line_break": Case(["run", str(data / "two\nlines.yaml"), *SYN],
                                              f"config file {data}/two\\nlines.yaml does not exist"),
        "deploy_folder_name_with_a_line_break": Case(["deploy", "--node-data", str(data / "two\nlines"),
                                                      str(data / "cut-config" / "config.yaml")],
                                                     f"--node-data {data}/two\\nlines is not a folder", out_dir=False),
        "resume_a_runs_file": Case(["run", "--resume", str(data / "cut-config" / "config.yaml")],
                                   f"{data / 'cut-config' / 'config.yaml'} is a file of a run",
                                   f"pass its directory, fedlt run --resume {data / 'cut-config'}", out_dir=False),
        "resume_non_run_dir": Case(["run", "--resume", str(data / "not-a-run")], str(data / "not-a-run"),
                                   "not a fedlt run directory", "pass the directory of a run", out_dir=False),
        # a shared run directory whose checkpoint.pt would run code when unpickled (see make_data_folders)
        **{f"resume_{kind}": Case(["run", "--resume", str(data / kind)], str(data / kind / "checkpoint.pt"),
                                  "written by an older fedlt or not a fedlt checkpoint", "start the run again",
                                  out_dir=False) for kind in MALICIOUS},
        "out_dir_is_a_file": Case(["run", *SYN, f"run.out_dir={data / 'a-file'}"], str(data / "a-file"),
                                  "set run.out_dir to a writable folder", out_dir=False),
        "table_non_run_dir": Case(["table", str(data / "not-a-run")], str(data / "not-a-run"), "summary.json",
                                  out_dir=False),
        "table_cut_off_summary": Case(["table", str(data / "cut-off-run")], str(data / "cut-off-run" / "summary.json"),
                                      "not a readable run summary", "invalid JSON", "fedlt run --resume", out_dir=False),
        # output paths and option values are checked before any work starts
        "report_out_is_a_file": Case(["report", str(data / "not-a-run"), "--out", str(data / "a-file")],
                                     f"--out {data / 'a-file'} is a file", "give a folder", out_dir=False),
        "describe_out_under_a_file": Case(["data", "describe", *SYN, "--out", str(data / "a-file" / "sub")],
                                          f"{data / 'a-file'} is a file, not a folder", out_dir=False),
        "speed_out_is_a_folder": Case(["bench", "speed", *SYN, "--rounds", "1", "--out", str(data / "empty")],
                                      f"--out {data / 'empty'} is a folder", "path of a file", out_dir=False),
        "speed_bad_override": Case(["bench", "speed", *SYN, "fl.rounds=abc"], "fl.rounds", "valid integer", out_dir=False),
        "speed_zero_rounds": Case(["bench", "speed", *SYN, "--rounds", "0"], "--rounds 0", "1 or more", out_dir=False),
        "speed_bad_compare": Case(["bench", "speed", *SYN, "--backends", "--compare", "sequential,warp"],
                                  "--compare sequential,warp", "sequential, parallel, vectorized", out_dir=False),
        "speed_compare_without_backends": Case(["bench", "speed", *SYN, "--compare", "graphed"], "--compare graphed",
                                               "add --backends", out_dir=False),
        "profile_bad_backend": Case(["bench", "profile", *SYN, "--backends", "sequential,fast"], "--backends sequential,fast",
                                    "sequential, parallel, vectorized", out_dir=False),
        "profile_bad_model": Case(["bench", "profile", *SYN, "--models", "resnet9"], "unknown model 'resnet9'",
                                  out_dir=False),
        "empty_out": Case(["report", str(data / "not-a-run"), "--out", ""], "option --out was given an empty value",
                          out_dir=False),
        "bench_out_is_a_run": Case(["bench", str(data / "suite.yaml"), "--out", str(data / "cut-config"), "--dry-run"],
                                   f"--out {data / 'cut-config'} is the folder of a run", out_dir=False),
        "suite_given_to_run": Case(["run", str(data / "suite.yaml")], "is a benchmark suite, not a run config",
                                   "fedlt bench"),
        "run_config_given_to_bench": Case(["bench", str(data / "run.yaml"), "--dry-run"],
                                          "is a run config, not a suite", "fedlt run", out_dir=False),
        "rounds_beyond_any_run": Case(["run", *SYN, "fl.rounds=1000000000000000000000"], "fl.rounds",
                                      "less than or equal to 1000000"),
        "profile_parallel": Case(["bench", "profile", *SYN, "--backends", "sequential,parallel"],
                                 "--backends parallel", "worker processes", out_dir=False),
        "paper_rounds_not_a_paper_suite": Case(["bench", "paper-rounds", "demo"], "demo is not a paper suite",
                                               "paper-creff", out_dir=False),
        "speed_tiny_synthetic": Case(["bench", "speed", *SYN, "--backends", "--synthetic-size", "0"],
                                     "--synthetic-size 0", "use 8 or more", out_dir=False),
        "profile_tiny_synthetic": Case(["bench", "profile", *SYN, "--synthetic-size", "4"], "--synthetic-size 4",
                                       "use 8 or more", out_dir=False),
        "profile_zero_clients": Case(["bench", "profile", *SYN, "--sampled", "0"], "--sampled 0", "counts >= 1",
                                     out_dir=False),
        "paper_rounds_bad_backend": Case(["bench", "paper-rounds", "paper-creff", "--backends", "turbo"],
                                         "--backends turbo", "auto, sequential", out_dir=False),
        "paper_rounds_zero_rows": Case(["bench", "paper-rounds", "--rows", "0"], "--rows 0", "1 or more", out_dir=False),
        "paper_rounds_unknown_suite": Case(["bench", "paper-rounds", "paper-nosuch"], "paper-nosuch", out_dir=False),
        "paper_rounds_unknown_row": Case(["bench", "paper-rounds", "paper-creff", "--row", "paper-creff:SFD"],
                                         "--row paper-creff:SFD names no row", "paper-creff: CReFF, FedProx",
                                         out_dir=False),
        "engines_missing_config": Case(["bench", "engines", str(data / "nope.yaml")], "fedlt bench engines needs a "
                                       f"config file first, got {data / 'nope.yaml'}, which is no file", out_dir=False),
        "deploy_missing_config": Case(["deploy", str(data / "nope.yaml"), "--workdir", str(data / "deploy")],
                                      "fedlt deploy needs a config file first", out_dir=False),
        "deploy_nothing": Case(["deploy", "--workdir", str(data / "deploy")],
                               "the deploy command needs a config file (or --resume RUN_DIR)", out_dir=False),
        "deploy_resume_non_run": Case(["deploy", "--resume", str(data / "not-a-run")], f"--resume {data / 'not-a-run'} "
                                      "is not a fedlt run directory (no config.yaml); pass a run's folder", out_dir=False),
        "deploy_resume_in_process": Case(["deploy", "--resume", str(data / "malicious-pickle")],  # its file unread
                                         "ran in-process (engine=inprocess); resume it with fedlt run --resume",
                                         out_dir=False),
        "engines_zero_nodes": Case(["bench", "engines", "configs/synthetic_smoke.yaml", "--nodes", "0"], "--nodes 0",
                                   "1 or more SuperNodes", out_dir=False),
        "duplicate_seeds": Case(["bench", "run", "demo", "--seeds", "0,0", "--dry-run"], "--seeds 0,0", "distinct",
                                out_dir=False),
        "empty_seeds": Case(["bench", "run", "demo", "--seeds", "", "--dry-run"], "--seeds '': give whole numbers >= 0",
                            out_dir=False),
        "underscore_seeds": Case(["bench", "run", "demo", "--seeds", "0_1", "--dry-run"],  # int() reads 1
                                 "--seeds '0_1': give whole numbers >= 0", out_dir=False),
        "negative_seeds": Case(["bench", "run", "demo", "--seeds", "-1", "--dry-run"],
                               "--seeds '-1': give whole numbers >= 0 separated by commas", out_dir=False),
        # usage errors (typer/click) are one line too
        "unknown_option": Case(["run", "--nosuch"], "No such option '--nosuch'", "see `fedlt run --help`", out_dir=False),
        "bad_option_value": Case(["bench", "run", "demo", "--workers", "abc"], "'--workers'", "not a valid integer",
                                 "see `fedlt bench run --help`", out_dir=False),
        "unknown_command": Case(["nosuchcmd"], "No such command 'nosuchcmd'", out_dir=False),
        "misspelt_command": Case(["benchh"], "No such command 'benchh'. Did you mean 'bench'?; see `fedlt --help`",
                                 out_dir=False),  # typer's and click's suggestion, once
        "config_after_override": Case(["run", "fl.rounds=1", "configs/synthetic_smoke.yaml"],
                                      "'configs/synthetic_smoke.yaml' is a config file among the key=value overrides; "
                                      "give it first", out_dir=False),
        "override_before_suite": Case(["bench", "fl.rounds=1", "demo"], "'fl.rounds=1' is a key=value override where "
                                      "the suite is expected; give the suite first", out_dir=False),
        "option_without_value": Case(["run", "--resume"], "Option '--resume' requires an argument", out_dir=False),
    }


def make_data_folders(data: Path) -> None:
    (data / "empty").mkdir(parents=True)
    garbage = data / "fmnist-garbage"
    garbage.mkdir()
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (garbage / name).write_bytes(b"this is not an IDX file, only some garbage bytes " * 4)
    (data / "not-a-run").mkdir()
    (data / "not-a-run" / "notes.txt").write_text("not a run\n")
    (data / "a-file").write_text("not a folder\n")
    (data / "cut-off-run").mkdir()
    (data / "cut-off-run" / "summary.json").write_text('{"method": "fedavg", "fin')
    (data / "cut-config").mkdir()  # a run folder's config.yaml cut short in the middle of loss:
    (data / "cut-config" / "config.yaml").write_text("data:\n  dataset: synthetic\nloss:\n  name")
    (data / "suite.yaml").write_text("name: tiny\nmethods:\n  - {name: FedAvg, overrides: [method=fedavg]}\n")
    (data / "run.yaml").write_text("seed: 0\nmethod: fedavg\ndata: {dataset: synthetic}\n")
    for kind, save in MALICIOUS.items():
        (data / kind).mkdir()
        (data / kind / "config.yaml").write_text(yaml.safe_dump(load_config(None, [*SYN, "fl.rounds=2"]).dump()))
        save({"round": 1, "server": Payload(data / f"{kind}-ran")}, data / kind / "checkpoint.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    """Run this module's CLI invocations up front (the successful run in the background)."""
    root = tmp_path_factory.mktemp("cli")
    env = cli_env(root)
    data = root / "data"
    make_data_folders(data)
    cases = error_cases(data)

    # the successful run, a plain `python -m fedlt.cli` and the slowest process: started first
    ok_cwd = root / "ok"
    (ok_cwd / "out").mkdir(parents=True)
    ok_log = (open(root / "ok.stdout", "w+"), open(root / "ok.stderr", "w+"))
    ok = subprocess.Popen([sys.executable, "-m", "fedlt.cli", "run", *TINY_RUN, f"run.out_dir={ok_cwd / 'out'}"],
                          cwd=ok_cwd, env=env, stdout=ok_log[0], stderr=ok_log[1], text=True)

    # the bad inputs, each in its own cwd with its own (empty) run.out_dir
    jobs, dirs = {}, {}
    for name, case in cases.items():
        cwd = root / name
        out = cwd / "out"
        out.mkdir(parents=True)
        jobs[name] = {"args": [*case.args, *([f"run.out_dir={out}"] if case.out_dir else [])], "cwd": str(cwd),
                      "stdout": str(root / f"{name}.stdout"), "stderr": str(root / f"{name}.stderr")}
        dirs[name] = (cwd, out)
    # probes of the driver itself: modules that crash or exit in the ways an interpreter must report
    probe_dir = root / "probes"
    probe_dir.mkdir()
    (probe_dir / "crash.py").write_text("print('before')\nraise RuntimeError('boom')\n")
    (probe_dir / "leave.py").write_text("import sys\nsys.exit('bad thing')\n")
    (probe_dir / "three.py").write_text("raise SystemExit(3)\n")
    probes = {name: {"module": name, "args": [], "cwd": str(probe_dir), "stdout": str(probe_dir / f"{name}.stdout"),
                     "stderr": str(probe_dir / f"{name}.stderr")} for name in ("crash", "leave", "three")}

    # help and listings: they must exit 0
    listings = {name: {"args": args, "cwd": str(root), "stdout": str(root / f"{name}.stdout"),
                       "stderr": str(root / f"{name}.stderr")} for name, args in LISTINGS.items()}

    everything = {**jobs, **probes, **listings}
    driver = subprocess.run([sys.executable, "-c", FORK_DRIVER, json.dumps(everything)], env=env, cwd=root,
                            capture_output=True, text=True, timeout=300)
    assert driver.returncode == 0, driver.stderr
    codes = json.loads(driver.stdout.splitlines()[-1])
    results = {name: Result(codes[name], Path(job["stdout"]).read_text(), Path(job["stderr"]).read_text())
               for name, job in everything.items()}

    def finished_ok() -> Result:
        ok.wait(timeout=300)
        for f in ok_log:
            f.seek(0)
        return Result(ok.returncode, ok_log[0].read(), ok_log[1].read())

    yield {"cases": cases, "results": results, "probes": {name: results[name] for name in probes}, "dirs": dirs,
           "listings": {name: results[name] for name in listings},
           "ok": (finished_ok, ok_cwd), "env": env, "data": data}
    ok.wait(timeout=300)
    for f in ok_log:
        f.close()


@pytest.mark.parametrize("name", list(error_cases(Path("/data"))))
def test_bad_input_is_one_error_line_with_exit_code_2(runs, name: str) -> None:
    case = runs["cases"][name]
    cwd, out = runs["dirs"][name]
    proc = runs["results"][name]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("fedlt: error: ")
    for fragment in case.fragments:
        assert fragment in line, (fragment, line)
    # nothing was written: no run directory under run.out_dir, nor under the default ./runs
    assert list(out.iterdir()) == []
    assert sorted(p.name for p in cwd.iterdir()) == ["out"]
    assert proc.stdout == ""


def test_plain_subprocess_agrees_with_the_fork_driver(runs, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    case = runs["cases"]["unknown_key"]
    plain = fedlt_cli([*case.args, f"run.out_dir={tmp_path / 'out'}"], tmp_path, runs["env"])
    forked = runs["results"]["unknown_key"]
    assert (plain.returncode, plain.stdout, plain.stderr) == (forked.returncode, forked.stdout, forked.stderr)
    assert list((tmp_path / "out").iterdir()) == []


def test_fork_driver_passes_on_tracebacks_and_exit_codes(runs) -> None:
    """The driver must not hide crashes, or the 'no Traceback' checks above would prove nothing."""
    probes = runs["probes"]
    assert {name: probes[name].returncode for name in probes} == {"crash": 1, "leave": 1, "three": 3}
    assert probes["crash"].stdout == "before\n"
    assert probes["crash"].stderr.startswith("Traceback") and "RuntimeError: boom" in probes["crash"].stderr
    assert probes["leave"].stderr == "bad thing\n"


@pytest.mark.parametrize("kind", list(MALICIOUS))
def test_resume_never_unpickles_code(runs, kind: str) -> None:
    """The refused checkpoint's payload never ran; it is live: torch.load(weights_only=False) runs it."""
    marker = runs["data"] / f"{kind}-ran"
    assert not marker.exists()
    with contextlib.suppress(RuntimeError):  # a bare pickle: torch unpickles it, then finds no magic number
        torch.load(runs["data"] / kind / "checkpoint.pt", weights_only=False)
    assert marker.exists()


def test_failed_runs_leave_the_given_paths_untouched(runs) -> None:
    assert sorted(p.name for p in (runs["data"] / "not-a-run").iterdir()) == ["notes.txt"]
    assert (runs["data"] / "a-file").read_text() == "not a folder\n"


# ---- a successful run ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def run_dir(runs) -> Path:
    finished_ok, cwd = runs["ok"]
    proc = finished_ok()
    assert proc.returncode == 0, proc.stderr
    made = list((cwd / "out").iterdir())
    assert len(made) == 1 and made[0].is_dir()
    # --quiet: the only output is one line that starts with the run directory
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{made[0]}: round 2: acc "), proc.stdout
    assert "Traceback" not in proc.stderr
    return made[0]


def test_run_writes_config_metrics_summary_report_and_plot(run_dir: Path) -> None:
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "report.md", "curves.png"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cfg = load_config(run_dir / "config.yaml")
    assert (cfg.data.dataset, cfg.data.num_clients, cfg.fl.rounds, cfg.fl.local_epochs) == ("synthetic", 10, 2, 1)
    assert cfg.run.out_dir == str(run_dir.parent)


def test_run_metrics_has_one_line_per_evaluated_round(run_dir: Path) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]  # eval.every=1: both rounds evaluated
    summary = json.loads((run_dir / "summary.json").read_text())
    groups = summary["shot_groups"]
    model_bytes = sum(t.numel() * t.element_size() for t in create_model("cnn", 10, 3, 16).state_dict().values())
    for row in rows:
        for key in ("acc", "many_acc", "medium_acc", "few_acc", "pm_acc", "per_class_acc", "comm"):
            assert key in row, key
        per_class = row["per_class_acc"]
        assert len(per_class) == 10
        assert all(0 <= a <= 100 for a in per_class) and 0 <= row["pm_acc"] <= 100
        # the test set is balanced (100 per class): overall accuracy is the mean per-class accuracy
        assert row["acc"] == pytest.approx(sum(per_class) / 10, abs=1e-3)
        for group in ("many", "medium", "few"):
            classes = groups[group]
            expected = sum(per_class[k] for k in classes) / len(classes) if classes else None
            assert row[f"{group}_acc"] == pytest.approx(expected, abs=1e-3)
        assert set(row["comm"]) == {"down_model", "down_payload", "up_model", "up_payload"}
        assert all(isinstance(v, int) and v >= 0 for v in row["comm"].values())
        # 4 of 10 clients per round (participation 0.4): each gets the model and sends one back
        assert row["comm"]["down_model"] == row["comm"]["up_model"] == 4 * model_bytes


def test_run_summary_labels_final_and_best_round(run_dir: Path) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final, best = summary["final"], summary["best_round"]
    assert final["round"] == 2 and final["acc"] == rows[-1]["acc"] and final["pm_acc"] == rows[-1]["pm_acc"]
    assert best["selected_by"] == "acc"
    assert best["acc"] == max(r["acc"] for r in rows)
    assert best["round"] in (1, 2) and rows[best["round"] - 1]["acc"] == best["acc"]
    assert summary["shot_rule"].startswith("count: many > 1000")  # 10 classes: the 1000/200 defaults
    assert sorted(sum(summary["shot_groups"].values(), [])) == list(range(10))
    assert summary["communication_bytes"]["down_model"] == sum(r["comm"]["down_model"] for r in rows)
    report = (run_dir / "report.md").read_text()
    assert "| final (headline) | 2 |" in report and "best round (by acc)" in report
    assert ", 2 rounds, 1 local epoch, model cnn," in report  # fl.local_epochs=1: one epoch, not "1 local epochs"
    assert summary["shot_rule"] in report


def test_table_prints_a_markdown_row_for_the_run(run_dir: Path, runs) -> None:
    proc = fedlt_cli(["table", str(run_dir)], run_dir.parent, runs["env"])
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("| run | method |") and lines[1].startswith("|---|")
    row = [cell.strip() for cell in lines[2].strip("|").split("|")]
    assert row[:4] == [run_dir.name, "fedavg", "ce", "2"]
    assert row[4] == f"{summary['final']['acc']:.2f}"
    assert row[8] == f"{summary['final']['pm_acc']:.2f}"
    best = summary["best_round"]  # the figure that chose it named: test accuracy here, no validation split
    assert row[9] == f"{best['acc']:.2f} ({best['round']}, acc)" and best["selected_by"] == "acc"
    assert summary["shot_rule"] in proc.stdout and "one chosen by acc, the test accuracy itself, is an optimistic" \
        in proc.stdout


# ---- help and listings ----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(LISTINGS))
def test_help_and_listings_exit_0(runs, name: str) -> None:
    proc = runs["listings"][name]
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and proc.stdout.strip()
    if name.endswith("help"):
        assert proc.stdout.count("Usage") == 1, proc.stdout  # printed once


def test_top_level_help_lists_the_commands(runs) -> None:
    """Read from the Commands panel's first column: "run" is a word of other commands' help too."""
    import re

    panel = runs["listings"]["help"].stdout.split("Commands")[1]
    listed = re.findall(r"^\W (\w[\w-]*) ", panel, re.M)
    assert listed == ["run", "deploy", "methods", "calibrations", "datasets", "models", "table", "report", "bench",
                      "data"], panel


def _names(runs, command: str) -> list[str]:
    """First word of every line: listings print one entry per line, name first."""
    return [line.split()[0] for line in runs["listings"][command].stdout.splitlines() if line.strip()]


def test_methods_one_per_line(runs) -> None:
    names = _names(runs, "methods")
    assert {"fedavg", "fedprox", "centralized"} <= set(names)
    assert len(names) == len(set(names))


def test_a_methods_knobs_are_listed_with_their_defaults(runs) -> None:
    """`fedlt methods NAME` prints every knob of the method with its default, one per line; a method without
    knobs says so; an unknown name is one line and exit 2."""
    from typer.testing import CliRunner

    from fedlt.cli import app
    from fedlt.methods.fedyoyo import FedYoYoArgs

    lines = runs["listings"]["fedyoyo_knobs"].stdout.splitlines()
    assert lines[0].startswith("fedyoyo: FedYoYo") and lines[1] == "knobs (method_args.NAME=VALUE):"
    knobs = {line.split()[0]: line.split()[1] for line in lines[2:]}
    assert list(knobs) == list(FedYoYoArgs.model_fields)
    assert knobs["asd_average"] == "correct" and knobs["lam"] == "4" and knobs["warmup"] == "0.1667"
    assert runs["listings"]["fedavg_knobs"].stdout.splitlines()[1:] == ["no knobs of method_args"]
    # a method tuned through its own calibration (CReFF, SFD) lists the knobs that calibration reads
    creff = CliRunner().invoke(app, ["methods", "creff"]).stdout.splitlines()
    assert creff[1:3] == ["no knobs of method_args", "knobs of its calibration creff (calibration_args.NAME=VALUE):"]
    knobs = {line.split()[0]: line.split()[1] for line in creff[3:]}
    assert knobs["creff_feature_lr"] == "0.1" and knobs["retrain_batch_size"] == "32"
    assert not any(k.startswith(("safs_", "ccvr_")) or k == "retrain_lr" for k in knobs), knobs
    wrong = CliRunner().invoke(app, ["methods", "fedyoyoo"])
    assert wrong.exit_code == 2 and wrong.output.startswith("fedlt: error: unknown method 'fedyoyoo'")
    assert wrong.output.count("\n") == 1
    from fedlt.methods.base import Client, MethodArgs, MethodSpec, Server
    from fedlt.methods.registry import METHODS

    METHODS["needy"] = MethodSpec("needy", "a knob without default", Server, Client,
                                  type("NeedyArgs", (MethodArgs,), {"__annotations__": {"beta": float}}))
    try:
        shown = CliRunner().invoke(app, ["methods", "needy"]).stdout.splitlines()
    finally:
        del METHODS["needy"]
    assert shown[2].split() == ["beta", "(required)"], shown  # not pydantic's PydanticUndefined


def test_datasets_one_per_line(runs) -> None:
    names = _names(runs, "datasets")
    assert names == ["fmnist", "cifar10", "cifar100", "svhn", "cinic10", "imagenet_lt", "inat", "imagefolder",
                     "imagefolder_lt", "synthetic", "synthetic_cifar10", "synthetic_cifar100"]


def test_models_one_per_line(runs) -> None:
    names = _names(runs, "models")
    assert {"cnn", "resnet18"} <= set(names)
    assert len(names) == len(set(names))


def test_an_output_folder_the_system_will_not_write_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """A read-only file system (or a folder without write permission) is found by the output check,
    which every command runs first; an OSError naming a path that still escapes becomes one line."""
    import typer

    from fedlt import cli
    from fedlt.errors import ConfigError

    writable = os.access
    monkeypatch.setattr(cli.os, "access", lambda p, mode: Path(p) != tmp_path and writable(p, mode))
    with pytest.raises(ConfigError, match=f"^--out {tmp_path / 'new' / 'report'}: {tmp_path} is not writable; choose "
                                          "a folder you can write$"):
        cli._check_out(tmp_path / "new" / "report", folder=True)
    cli._check_out(tmp_path / "new" / "report", folder=True, writes=False)  # a dry run only reads
    monkeypatch.undo()
    cli._check_out(tmp_path / "new" / "report", folder=True)  # writable: no complaint, nothing made
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []
    if Path("/proc/self").is_dir():  # a file system that refuses new folders whatever the permissions say
        with pytest.raises(ConfigError, match=r"^--out /proc/x: /proc is not writable \(.+\); choose a folder"):
            cli._check_out(Path("/proc/x"), folder=True)

    def read_only():
        raise OSError(30, "Read-only file system", str(tmp_path / "x"))

    with pytest.raises(typer.Exit) as stop:
        cli._guard(read_only)
    assert stop.value.exit_code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"fedlt: error: Read-only file system: {tmp_path / 'x'}; choose a path fedlt can read and write (and room "
        "on its disk)"]
    with pytest.raises(OSError, match="no file"):  # without a path it is not the user's: the traceback stays
        cli._guard(lambda: (_ for _ in ()).throw(OSError("no file")))
    with pytest.raises(FileNotFoundError):  # nor is a missing file fedlt itself looked for: a bug keeps its traceback
        cli._guard(lambda: (_ for _ in ()).throw(FileNotFoundError(2, "No such file or directory", "/x")))


def test_an_interrupt_says_how_each_kind_of_work_goes_on(monkeypatch, capsys):
    """Ctrl-C ends with 130 and one line: an in-process run resumes from its folder, one that had not
    started (or ran on Flower) starts again, a bench resumes its unfinished cells, and any other command
    (a report) is run again."""
    import typer
    from typer.testing import CliRunner

    import fedlt.api
    from fedlt.cli import BENCH_HINT, _guard, app

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(fedlt.api, "run", interrupted)
    result = CliRunner().invoke(app, ["run", "data.dataset=synthetic", "--quiet"])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 130 and len(lines) == 1
    assert lines == ["fedlt: interrupted; there is nothing to resume (the run had not started, or ran on Flower); run "
                     "the same command again"]
    stop = KeyboardInterrupt()
    stop.resume_hint = "`fedlt run --resume runs/x` goes on from its checkpoint of round 2"
    monkeypatch.setattr(fedlt.api, "run", lambda *args, **kwargs: (_ for _ in ()).throw(stop))
    result = CliRunner().invoke(app, ["run", "data.dataset=synthetic", "--quiet"])
    assert result.exit_code == 130 and result.stderr.strip() == f"fedlt: interrupted; {stop.resume_hint}"
    with pytest.raises(typer.Exit):  # a bench's own cells in this process: the bench goes on, not the cell alone
        _guard(lambda: (_ for _ in ()).throw(stop), hint=BENCH_HINT)
    assert capsys.readouterr().err == "fedlt: interrupted; the same `fedlt bench` command runs the suite's unfinished " \
                                      "cells again\n"
    with pytest.raises(typer.Exit):  # a report, a table, an export: nothing of its own to resume
        _guard(lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert capsys.readouterr().err == "fedlt: interrupted; what it had written may be incomplete; run the same " \
                                      "command again\n"


def test_a_resume_interrupted_before_its_run_began_names_its_folder(monkeypatch, tmp_path):
    """`fedlt run --resume DIR` stopped while it loaded torch (seconds) said that there was nothing to resume,
    the line of a new run that had not started, of a folder that it had not touched."""
    from typer.testing import CliRunner

    import fedlt.api
    from fedlt.cli import app

    monkeypatch.setattr(fedlt.api, "resume", lambda *args, **kwargs: (_ for _ in ()).throw(KeyboardInterrupt))
    result = CliRunner().invoke(app, ["run", "--resume", str(tmp_path / "a run")])
    folder = f"'{tmp_path / 'a run'}'"  # quoted as a shell needs it
    assert result.exit_code == 130
    assert result.stderr == f"fedlt: interrupted; `fedlt run --resume {folder}` goes on from its checkpoint\n"


def test_the_command_line_loads_torch_only_for_a_command_that_needs_it():
    """Importing the package loaded torch (seconds) before the arguments were read: Ctrl-C in that window
    ended in a traceback, and --help waited for it. fedlt.run and fedlt.resume load it on first use."""
    import subprocess
    import sys

    probe = ("import sys, fedlt, fedlt.cli; before = 'torch' in sys.modules; from fedlt import run, resume; "
             "print(before, 'torch' in sys.modules, run.__module__, resume.__name__, fedlt.api.run is run, "
             "fedlt.methods.registry.__name__)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "True", "fedlt.api", "resume", "True", "fedlt.methods.registry"], \
        done.stderr
    with pytest.raises(AttributeError, match="module 'fedlt' has no attribute 'rnu'"):
        import fedlt

        fedlt.rnu


def test_ctrl_c_while_the_command_line_loads_is_one_line_and_the_package_loads_no_pydantic():
    """Ctrl-C in the first fraction of a second (the package imported pydantic for its config, the command
    line typer) ended in a traceback of the import it cut short; importing the package alone now loads
    neither, and a Ctrl-C while the command line loads is one line, exit 130. Once loaded, Ctrl-C is the
    importer's again."""
    import subprocess
    import sys

    probe = ("import sys, fedlt; print('pydantic' in sys.modules, 'typer' in sys.modules, "
             "fedlt.load_config.__module__, fedlt.Config.__name__)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "False", "fedlt.config", "Config"], done.stderr
    ctrl_c_amid_typer = (  # a finder that signals when typer's import begins, then lets it go on
        "import os, signal, sys\n"
        "class Finder:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'typer':\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Finder())\n"
        "import fedlt.cli\n"
        "print('loaded')\n")
    done = subprocess.run([sys.executable, "-c", ctrl_c_amid_typer], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "fedlt: interrupted while starting; nothing was "
                                                                    "done\n")
    after = "import signal, fedlt.cli\nprint(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    assert subprocess.run([sys.executable, "-c", after], capture_output=True, text=True, timeout=120).stdout == "True\n"


def test_a_run_ended_by_sigterm_stops_its_workers_and_names_its_folder(tmp_path):
    """SIGTERM ended `fedlt run` at once: no line, no `finally` (a terminal's cursor left hidden), and the
    worker processes of run.backend=parallel went on alone. It now unwinds as Ctrl-C does and exits 143
    with the folder's resume command; a resume that would change the run is refused by name."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    from typer.testing import CliRunner

    from conftest import wait_until_group_ends
    from fedlt.cli import app

    run_dir = tmp_path / "r"
    command = [sys.executable, "-m", "fedlt.cli", "run", "data.dataset=synthetic", "data.num_clients=4",
               "fl.rounds=400", "eval.every=100", "run.checkpoint_every=1", "run.backend=parallel", "run.workers=2",
               "run.threads=1", f"run.out_dir={tmp_path}", "run.name=r"]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoint.pt").is_file():
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.2)
    os.kill(run.pid, signal.SIGTERM)  # the run alone, as a scheduler's kill would
    _, err = run.communicate(timeout=120)
    assert run.returncode == 143 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(rf"fedlt: interrupted by SIGTERM; `fedlt run --resume {re.escape(str(run_dir))}` goes on from "
                        r"its checkpoint of round \d+", last), last
    wait_until_group_ends(run.pid)  # the workers were stopped before the run ended
    refused = CliRunner().invoke(app, ["run", "--resume", str(run_dir), "fl.rounds=3"])
    assert refused.exit_code == 2 and "fl.rounds: a resumed run goes on with its saved config" in refused.stderr
    with open(run_dir / "config.yaml") as saved:
        assert "backend: parallel" in saved.read()


def test_every_commands_help_says_what_its_positional_arguments_are():
    """From click 8.5 click's Argument took a help of its own and reset Typer's: `fedlt run --help` listed
    ARGS with no word of what they are, and rich markup ate the brackets of "[CONFIG.yaml] [key=value ...]"."""
    from typer.testing import CliRunner

    from fedlt.cli import app

    for command, words in ((["run"], ["[CONFIG.yaml]", "[key=value ...]"]), (["bench", "run"], ["a built-in suite"]),
                           (["bench", "paper-rounds"], ["[SUITE ...]"]), (["table"], ["run directories to compare"])):
        shown = CliRunner().invoke(app, [*command, "--help"], terminal_width=200).output
        assert all(word in shown for word in words), (command, shown)


def test_a_model_or_method_state_past_memory_is_one_line_before_any_file(tmp_path: Path) -> None:
    """The model and the method's server state are built before the run folder, outside the rounds' memory
    handling: GBME's expert_width, SFD's projector_hidden and CReFF's features per class past any memory (or
    past 64 bits), and a calibration's size of 2**64 in a round (torch's ValueError / TypeError there), ended
    in a traceback. Sizes beyond any address space, so the allocator refuses them whatever the overcommit. The
    features a calibration builds after the last round are counted before the first (one line, no folder)."""
    from typer.testing import CliRunner

    from fedlt.cli import app

    out = tmp_path / "runs"
    base = ["run", *SYN, "data.num_clients=4", "fl.rounds=1", "run.threads=1", f"run.out_dir={out}", "--quiet"]
    built = ("fedlt: error: out of memory building the model and the method's state, before any file is written: "
             "{}; lower what sizes them (the model, a method's width such as method_args.expert_width or "
             "projector_hidden, a calibration's *_per_class)")
    beyond = "a tensor larger than any memory was asked for (its size does not fit in 64 bits)"
    for knobs, line in [
        (["method=gbme", "loss.name=bsm", "method_args.expert_width=3e38"], built.format(beyond)),
        (["method=sfd", "method_args.projector_hidden=10000000000000"],
         built.format("the CPU allocator was asked for 5.1 PB")),
        (["method=creff", "calibration_args.creff_features_per_class=10000000000000"],
         built.format("the CPU allocator was asked for 51.2 PB")),
        (["method=sfd", "calibration_args.safs_rff_dim=18446744073709551616"],
         f"fedlt: error: out of memory in round 1: {beyond}; lower what sizes the step "),
        (["method=fedavg", "calibration=oracle", "calibration_args.oracle_per_class=18446744073709551616"],
         "fedlt: error: calibration=oracle builds up to 184,467,440,737,095,516,160 features of width 128 after the last "
         "round (about 1.9e+23 bytes), more than the ")]:
        result = CliRunner().invoke(app, [*base, *knobs])
        assert result.exit_code == 2, result.stderr
        [got] = result.stderr.strip().splitlines()
        assert got.startswith(line), got
        assert not out.exists() or list(out.iterdir()) == []


def test_running_out_of_memory_is_one_line_naming_what_sizes_the_step_and_how_to_go_on(tmp_path: Path) -> None:
    """A step that asks for more memory than the machine has (here 5.1 PB of SAFS's random features, beyond
    any address space, so the allocator refuses it whatever the kernel's overcommit) ended in a traceback."""
    from fedlt.errors import out_of_memory

    proc = fedlt_cli(["run", *SYN, "fl.rounds=1", "data.num_clients=3", "run.threads=1", "method=sfd",
                      "calibration_args.safs_rff_dim=10000000000000", f"run.out_dir={tmp_path}"], tmp_path,
                     cli_env(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith("fedlt: error: out of memory in round 1: the CPU allocator was asked for 5.1 PB; lower "
                           "what sizes the step (fl.batch_size, eval.batch_size, run.workers / run.streams, a "
                           "calibration's *_per_class or safs_rff_dim, the model); "), line
    assert f"the model); the run stopped before its first result, so its folder {tmp_path}/sfd-" in line, line
    assert line.endswith(" is removed; start the run again"), line
    assert list(tmp_path.glob("sfd-*")) == []  # nothing half-written: a new try makes a new folder
    cuda = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB")
    assert out_of_memory(cuda) == "the GPU ran out of memory (asked for 2.00 GiB)"
    assert out_of_memory(MemoryError()) == "Python could not allocate memory"
    beyond = "a tensor larger than any memory was asked for (its size does not fit in 64 bits)"
    assert out_of_memory(RuntimeError("Storage size calculation overflowed with sizes=[10**18, 128]")) == beyond
    assert out_of_memory(OverflowError("int too big to convert")) == beyond  # a size knob of 1e20
    assert out_of_memory(OverflowError("math range error")) is None
    assert out_of_memory(RuntimeError("shape mismatch")) is None and out_of_memory(ValueError("x")) is None

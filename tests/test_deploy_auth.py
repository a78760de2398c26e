"""The deploy command's sites and SuperNode authentication: the command lines and node configs it
builds (read back with Flower 1.41's own parsers), its refusals, and one real TLS deployment with
SuperNode authentication where only the registered SuperNodes get in."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
os.environ["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"

from fedlt.deploy import (  # noqa: E402
    HOST, Site, free_port, local_federation, main, make_node_key, partition_sites, plan_deployment, superlink_args,
    supernode_args,
)
from fedlt.errors import ConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "configs" / "synthetic_smoke.yaml")


def _sites(tmp_path: Path, *names: str) -> Path:
    folder = tmp_path / "sites"
    for name in names:
        (folder / name).mkdir(parents=True)
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """The smoke config's federation as node folders (fedlt data export)."""
    from fedlt.config import load_config
    from fedlt.data.export import export_federation

    out = tmp_path_factory.mktemp("export") / "federation"
    return export_federation(load_config(SMOKE, ["data.num_clients=2"]), out)


def _filled(folder: Path, exported: Path) -> Path:
    """Every site folder of ``folder`` holds a copy of an exported node."""
    for site in folder.iterdir():
        if site.is_dir() and not site.name.startswith("."):
            shutil.copytree(exported / "nodes" / "client-0", site, dirs_exist_ok=True)
    return folder


def test_node_data_plans_one_supernode_per_site_folder_that_flower_reads_back(tmp_path, exported):
    """Each subfolder (sorted by name; hidden ones and files skipped) is a SuperNode whose
    --node-config Flower's own parser turns into the absolute folder and the site's name (a space
    and a backslash included); the run is told flower.node_data, the site count and the server's
    test set; --tls --auth flags are ones flower-superlink and flower-supernode 1.41 accept."""
    from flwr.common.config import parse_config_args
    from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink
    from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

    from fedlt.config import load_config

    folder = _filled(_sites(tmp_path, "site-b", "site a", "back\\slash", ".cache"), exported)
    (folder / "notes.txt").write_text("not a site")
    test = exported / "server" / "test"
    plan = plan_deployment(SMOKE, ["fl.rounds=1"], node_data=folder, server_test=test, tls=True, auth=True)
    assert [s.name for s in plan.sites] == ["back\\slash", "site a", "site-b"]
    for site in plan.sites:
        assert parse_config_args([site.node_config]) == {"data": str((folder / site.name).resolve()), "name": site.name}
    cfg = load_config(str(plan.config), plan.overrides)
    assert cfg.flower.node_data and cfg.flower.min_nodes == 3 and cfg.eval.test_data == str(test.resolve())
    assert cfg.data.num_clients == 3  # one client per site, whatever the exported config said
    assert cfg.engine == "flower" and Path(cfg.run.out_dir).is_absolute()

    ca, key = tmp_path / "ca.crt", tmp_path / "keys" / "supernode1"
    node = _parse_args_run_supernode().parse_args(
        ["--isolation", "process", *supernode_args(plan.sites[1], f"{HOST}:9", ca, key, 60)])
    assert (node.root_certificates, node.auth_supernode_private_key, node.insecure) == (str(ca), str(key), False)
    assert parse_config_args([node.node_config]) == {"data": str((folder / "site a").resolve()), "name": "site a"}
    link = _parse_args_run_superlink().parse_args(superlink_args(9, tmp_path / "state.db", (ca, ca, key), auth=True))
    assert link.enable_supernode_auth and not link.insecure and link.ssl_ca_certfile == str(ca)
    plain = _parse_args_run_superlink().parse_args(superlink_args(9, tmp_path / "s.db", None, False))
    assert plain.insecure and not plain.enable_supernode_auth

    default = plan_deployment(SMOKE, [])  # no --node-data: partition I of N, as before
    assert [parse_config_args([s.node_config]) for s in default.sites] == [
        {"partition-id": i, "num-partitions": 3} for i in range(3)]
    assert "flower.node_data=true" not in default.overrides and default.sites == partition_sites(3)
    with pytest.raises(ConfigError, match=re.escape("--nodes 7: the federation has 6 clients (data.num_clients) and "
                                                    "each SuperNode serves at least one; use --nodes 6 or fewer")):
        plan_deployment(SMOKE, ["data.num_clients=6"], nodes=7)
    assert len(plan_deployment(SMOKE, ["data.num_clients=6"], nodes=6).sites) == 6


def test_a_site_without_the_test_folder_the_run_evaluates_on_is_refused_before_anything_starts(tmp_path, exported):
    from fedlt.errors import DataError

    folder = _filled(_sites(tmp_path, "a", "b"), exported)
    shutil.rmtree(folder / "b" / "test")
    with pytest.raises(DataError, match=rf"^{re.escape(str(folder / 'b'))} has no test/ folder, which the run "
                                         r"evaluates on .*eval.test_data=PATH$"):
        plan_deployment(SMOKE, ["fl.rounds=1"], node_data=folder)
    # without personalized accuracy and with the server's test set, no site needs one
    plan_deployment(SMOKE, ["fl.rounds=1", "eval.personalized=false"], node_data=folder,
                    server_test=exported / "server" / "test")


@pytest.mark.parametrize(("overrides", "refusal"), [
    (["method=fedyoyo", "data.augment=crop_flip"], "method fedyoyo + data.augment=crop_flip: fedyoyo builds its own "
                                                   "weak and strong views; remove data.augment"),
    (["method=gbme", "loss.name=bsm", "loss.prior=global"], "method gbme takes its prior from method_args.prior"),
    (["method=gbme", "loss.name=bsm", "method_args.num_experts=3"],
     "method_args.num_experts=3 needs at least as many clients (data.num_clients=2)"),
])
def test_a_methods_own_refusals_end_the_plan_before_anything_starts(tmp_path, exported, overrides, refusal):
    """What a method's server refuses of the config is refused by the plan, with the site count as the
    number of clients (two sites here, whatever the config file's data.num_clients says), not by a ServerApp after the
    SuperLink and SuperNodes started."""
    folder = _filled(_sites(tmp_path, "a", "b"), exported)
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        plan_deployment(SMOKE, ["fl.rounds=1", *overrides], node_data=folder)


@pytest.mark.parametrize(("overrides", "refusal"), [
    (["data.num_clients=5"], "data.num_clients=5 contradicts --node-data {folder} (2 site folders), which sets "
                             "data.num_clients=2; drop the override"),
    (["flower.node_data=false"], "flower.node_data=false contradicts --node-data"),
    (["engine=inprocess"], "a deployment runs on Flower; drop the engine= override"),
    (["engine=[x"], "a deployment runs on Flower; drop the engine= override"),
    (["data.num_clients=[1"], "data.num_clients=[1 contradicts --node-data"),
    (['run.name=q"x'], "override 'run.name=q\"x' holds a quote or a backslash, which Flower's run config cannot"),
    (["run.name=bob's"], "override \"run.name=bob's\" holds a quote or a backslash"),
    (["run.name=a\\tb"], "override 'run.name=a\\\\tb' holds a quote or a backslash"),
    (["eval.val_data=/nonexistent/val"], "eval.val_data=/nonexistent/val is not a folder; give the server's set"),
    (["run.out_dir={tmp}/afile"], "run.out_dir {tmp}/afile is a file; give a folder"),
])
def test_what_a_deployment_would_fail_on_after_starting_is_refused_by_its_plan(tmp_path, exported, overrides, refusal):
    """Overrides that contradict the sites (they were silently replaced), that Flower's run config cannot
    carry, or that name a server set or output folder the ServerApp cannot use: each ended a started
    federation after half a minute (exit 1 where bad input is 2), or not at all; now one line first."""
    from fedlt.errors import DataError

    folder = _filled(_sites(tmp_path, "a", "b"), exported)
    (tmp_path / "afile").write_text("")  # where the run folder would go
    given = {"{folder}": str(folder), "{tmp}": str(tmp_path)}
    for placeholder, value in given.items():
        overrides, refusal = [o.replace(placeholder, value) for o in overrides], refusal.replace(placeholder, value)
    with pytest.raises((ConfigError, DataError)) as err:
        plan_deployment(SMOKE, ["fl.rounds=1", *overrides], node_data=folder)
    assert refusal in str(err.value) and "\n" not in str(err.value)
    plan_deployment(SMOKE, ["fl.rounds=1", "data.num_clients=2", "flower.node_data=true"], node_data=folder)


def test_a_path_flowers_run_config_cannot_carry_is_refused_by_the_plan_and_one_it_can_goes_through(tmp_path,
                                                                                                    exported):
    """The server's test set, the run folder and the config reach the ServerApp inside Flower's run config:
    a quote in one of their paths failed there, after the federation had started; a space is carried."""
    import shlex

    from flwr.common.config import parse_config_args

    from fedlt.deploy import run_config

    folder = _filled(_sites(tmp_path, "a", "b"), exported)
    quoted = tmp_path / "it's" / "test"
    shutil.copytree(exported / "server" / "test", quoted)
    with pytest.raises(ConfigError, match=re.escape(f"{str(quoted.resolve())!r} (the deployment's eval.test_data) "
                                                    "holds a quote or a backslash, which Flower's run config cannot "
                                                    "carry; move or rename that folder")):
        plan_deployment(SMOKE, ["fl.rounds=1"], node_data=folder, server_test=quoted)
    odd_config = tmp_path / 'c"q' / "smoke.yaml"
    odd_config.parent.mkdir()
    shutil.copy(SMOKE, odd_config)
    with pytest.raises(ConfigError, match=r"^the config path .* holds a quote or a backslash"):
        plan_deployment(str(odd_config), ["fl.rounds=1"], node_data=folder)
    spaced = tmp_path / "server set" / "test"
    shutil.copytree(exported / "server" / "test", spaced)
    plan = plan_deployment(SMOKE, ["fl.rounds=1", "run.name=a b"], node_data=folder, server_test=spaced)
    carried = parse_config_args([run_config(plan.config, plan.overrides)])
    assert shlex.split(carried["overrides"]) == plan.overrides
    assert f"eval.test_data={spaced.resolve()}" in plan.overrides


def test_a_deployments_server_sets_are_one_folder_each_and_go_to_the_serverapp_as_checked(tmp_path, exported,
                                                                                         monkeypatch):
    """--server-test with another eval.test_data was settled by whichever came last; a relative server set
    was checked against this folder but read by a ServerApp running in the deployment's own."""
    folder = _filled(_sites(tmp_path, "a", "b"), exported)
    test = exported / "server" / "test"
    with pytest.raises(ConfigError, match=r"eval.test_data=/elsewhere contradicts --node-data .* and --server-test "):
        plan_deployment(SMOKE, ["eval.test_data=/elsewhere"], node_data=folder, server_test=test)
    monkeypatch.chdir(exported)
    plan = plan_deployment(SMOKE, ["fl.rounds=1", "eval.test_data=server/test"], node_data=folder)
    assert f"eval.test_data={test.resolve()}" in plan.overrides


def test_a_node_key_is_an_openssh_p384_key_pair_flower_loads(tmp_path):
    """What `ssh-keygen -t ecdsa -b 384 -N ""` writes: a private key only its owner reads, and a
    public key `flwr supernode register` accepts."""
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key

    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    key = tmp_path / "keys" / "node"
    public = make_node_key(key)
    assert public == tmp_path / "keys" / "node.pub" and public.read_text().startswith("ecdsa-sha2-nistp384 ")
    assert key.stat().st_mode & 0o777 == 0o600
    private = load_ssh_private_key(key.read_bytes(), None)
    assert try_load_public_key(public) == public_key_to_bytes(private.public_key())
    first = public.read_text()
    make_node_key(key)  # a second call makes a fresh pair (a deploy never reuses a node's key)
    assert public.read_text() != first and key.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("args, message", [
    (["--nodes", "3", "--node-data", "{sites}"], "--nodes 3 conflicts with --node-data {sites}, which has 2 site "
                                                 "folder(s), one SuperNode each; drop --nodes"),
    (["--node-data", "{empty}"], "--node-data {empty} has no subfolders; put each site's data in a folder"),
    (["--node-data", "{tmp}/missing"], "--node-data {tmp}/missing is not a folder"),
    (["--auth"], "--auth needs --tls: Flower 1.41's SuperLink refuses --enable-supernode-auth without TLS"),
    (["--server-test", "{tmp}"], "--server-test is the server's test set of a federation whose sites hold"),
    (["--node-data", "{sites}", "--server-test", "{tmp}/none"], "--server-test {tmp}/none is not a folder"),
    (["--node-data", "{quoted}"], "--node-data folder '{quoted}/say \"hi\"' has a double quote"),
    (["flower.node_data=true"], "flower.node_data=true needs SuperNodes that hold their data; use --node-data DIR"),
    (["--nodes", "0"], "--nodes 0: use 1 or more SuperNodes"),
], ids=["nodes-conflict", "no-subfolders", "missing", "auth-without-tls", "server-test-alone", "server-test-missing",
        "double-quote", "node-data-override", "zero-nodes"])
def test_deploy_refuses_bad_sites_in_one_line_before_starting_anything(tmp_path, capsys, args, message):
    sites, empty = _sites(tmp_path, "a", "b"), tmp_path / "empty"
    empty.mkdir()
    quoted = tmp_path / "quoted"
    (quoted / 'say "hi"').mkdir(parents=True)
    names = {"sites": sites, "empty": empty, "tmp": tmp_path, "quoted": quoted}
    work = tmp_path / "work"
    argv = [a.format(**names) for a in args]
    options, overrides = [a for a in argv if "=" not in a], [a for a in argv if "=" in a]
    assert main(["--workdir", str(work), *options, SMOKE, *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedlt: error: " + message.format(**names)), err
    assert not work.exists()  # no process, no folder


def test_deploy_refuses_a_malformed_site_folder_before_starting_anything(tmp_path, capsys, exported):
    """Each site's folder is read as its SuperNode will read it, before any process starts."""
    sites = _filled(_sites(tmp_path, "a", "b"), exported)
    stray = sites / "b" / "train" / "not-a-class"
    stray.mkdir()
    work = tmp_path / "work"
    assert main(["--workdir", str(work), "--node-data", str(sites), SMOKE]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"unknown class folder {stray}; name class folders after data.classes" in err, err
    assert not work.exists()


def test_fedlt_deploy_and_the_script_are_the_same_command(tmp_path):
    """`fedlt deploy` (what scripts/flower_deploy.sh runs) refuses like `python -m fedlt.deploy`."""
    sites = _sites(tmp_path, "a", "b")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FEDLT_PYTHON": sys.executable}
    want = f"fedlt: error: --nodes 5 conflicts with --node-data {sites}, which has 2 site folder(s)"
    script = ["bash", str(ROOT / "scripts" / "flower_deploy.sh")]
    for command in ([sys.executable, "-m", "fedlt.cli", "deploy"], script):
        done = subprocess.run([*command, "--nodes", "5", "--node-data", str(sites), "--workdir", str(tmp_path / "w"),
                               SMOKE], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith(want), done.stderr
    assert not (tmp_path / "w").exists()


def test_the_script_without_an_environment_says_how_to_make_one(tmp_path):
    """scripts/flower_deploy.sh with a Python that lacks torch and flwr: one line naming set-up, exit 2."""
    bare = tmp_path / "python"
    bare.write_text("#!/bin/sh\nexit 1\n")  # a Python whose imports all fail
    bare.chmod(0o755)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "flower_deploy.sh"), SMOKE], capture_output=True, text=True,
                          env={**os.environ, "FEDLT_PYTHON": str(bare)}, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"fedlt: error: {bare} cannot import torch and flwr: run 'source scripts/setup.sh'")

def _live(work: Path) -> list[int]:
    """Live processes that inherited the deployment's FLWR_HOME."""
    mark = f"FLWR_HOME={work / 'flwr-home'}".encode()
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if Path(env.parent, "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z" and \
                    mark in env.read_bytes().split(b"\0"):
                found.append(int(env.parent.name))
        except OSError:
            continue
    return found


def test_with_tls_and_auth_only_registered_supernodes_join_and_the_run_finishes(tmp_path):
    """--tls --auth: the SuperLink runs --enable-supernode-auth and each of the 2 SuperNodes signs
    with its own key, registered beforehand with `flwr supernode register`. A SuperNode with an
    unregistered key, and one with no key (which would register itself), are refused: each exits
    with Flower's refusal in its log, the SuperLink's log shows the refused calls, and neither ever
    appears among the SuperLink's nodes. A 1-round FedAvg run over the registered two finishes."""
    cfg = {"seed": 3, "method": "fedavg",
           "data": {"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5, "num_clients": 2},
           "fl": {"rounds": 1, "participation": 1.0, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
           "eval": {"every": 1}, "run": {"out_dir": str(tmp_path / "runs"), "name": "auth", "threads": 1}}
    config, work = tmp_path / "auth.yaml", tmp_path / "federation"
    config.write_text(json.dumps(cfg))
    started = time.monotonic()
    with local_federation(work, nodes=2, tls=True, auth=True, startup_s=60) as fed:
        assert len(set(fed.node_ids)) == 2
        program = str(Path(sys.executable).with_name("flower-supernode"))
        stranger, strangers = work / "keys" / "stranger", {}
        make_node_key(stranger)  # a well-formed key pair nobody registered
        for name, key in (("unregistered", stranger), ("keyless", None)):
            args = supernode_args(Site(name, "partition-id=0 num-partitions=2"), f"{HOST}:{fed.port}", fed.ca, key, 30)
            strangers[name] = fed.start(f"{name}.log", program, *args, "--isolation", "process", "--host", HOST,
                                        "--port", str(free_port()))
        for name, proc in strangers.items():
            assert proc.wait(60) != 0, name
        unregistered = (work / "unregistered.log").read_text()
        assert "Failed to initialize the connection to the SuperLink" in unregistered
        assert "[code: 2004] Failed to activate SuperNode." in unregistered, unregistered[-2000:]
        keyless = (work / "keyless.log").read_text()
        assert "[code: 2001] SuperNode authentication is enabled. All SuperNodes must be registered" in keyless, \
            keyless[-2000:]
        link = (work / "superlink.log").read_text()
        assert "[/v1/fleet/activate-node][ApiError:2004]" in link  # the unregistered key, with why:
        assert "exception: No SuperNode found with the given public key." in link
        assert "[/v1/fleet/register-node][ApiError:2001]" in link  # self-registration is off

        fed.run(config, ["engine=flower"], timeout=180)  # its start waits for both registered SuperNodes
        link = (work / "superlink.log").read_text()  # a SuperNode may activate after the strangers are refused
        assert link.count('"POST /v1/fleet/activate-node HTTP/1.1" 200') == 2  # the registered two only
        listed = fed.flwr({"ls.log": ["supernode", "ls", "deploy", "--format", "json"]})["ls.log"]
        nodes = json.loads(listed[listed.index("{"):])["nodes"]
        assert sorted(int(n["node-id"]) for n in nodes) == sorted(fed.node_ids)
        assert {n["status"] for n in nodes} == {"online"}
        for i, node_id in enumerate(fed.node_ids):
            assert f"SuperNode ID: {node_id}" in (work / f"supernode{i}.log").read_text()
    summary = json.loads((tmp_path / "runs" / "auth" / "summary.json").read_text())
    assert summary.get("status", "finished") == "finished" and summary["final"]["round"] == 1
    deadline = time.monotonic() + 15
    while _live(work):
        assert time.monotonic() < deadline, "every process of the deployment gone within 15 s"
        time.sleep(0.25)
    print(f"TLS + auth deployment: {time.monotonic() - started:.1f} s")


def test_deploy_refuses_a_workdir_in_use_or_unusable_and_tls_without_openssl(tmp_path, capsys, monkeypatch):
    """Two deployments in one --workdir shared its Flower state and outcome file: the second started, read
    the first's SuperNodes and failed, and the first then reported the second's error. `python -m
    fedlt.deploy` ended a --workdir that is a file in a traceback, and --tls without openssl too (leaving a
    half-made certificate folder). Each is now one line, exit 2, with nothing started."""
    import fcntl

    work = tmp_path / "work"
    work.mkdir()
    held = os.open(work, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # as the deployment running there holds it
    try:
        assert main(["--workdir", str(work), SMOKE, "fl.rounds=1"]) == 2
    finally:
        os.close(held)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--workdir {work} is the folder of a deployment still running" in err, err
    assert list(work.iterdir()) == []  # nothing started there
    (tmp_path / "file").write_text("x")
    assert main(["--workdir", str(tmp_path / "file"), SMOKE]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"fedlt: error: --workdir {tmp_path / 'file'}"), err
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))
    assert main(["--workdir", str(tmp_path / "tls"), "--tls", SMOKE]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tls makes its certificates with openssl, which is not on PATH" in err, err
    assert not (tmp_path / "tls").exists()

"""Each rank's command line and environment, the options, and the ssh commands of other nodes (no processes)."""
from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest

from ds_recycle.launcher import cli
from ds_recycle.launcher.hosts import Layout, NodeSlots
from ds_recycle.launcher.job import NCCL_ENV, JobSpec, Program, worker_env, worker_specs
from ds_recycle.launcher.remote import exported_env, launcher_argv, ssh_command

TWO_NODES = Layout((NodeSlots("worker-0", (0, 1)), NodeSlots("worker-1", (1, 3))))


@pytest.fixture(autouse=True)
def _in_a_dir_with_scripts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run each test where the scripts the options name exist (the launcher checks)."""
    for name in ("t.py", "train.py"):
        (tmp_path / name).write_text("")
    monkeypatch.chdir(tmp_path)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_user_arguments_pass_through_untouched() -> None:
    args = _args("--num_gpus", "2", "train.py", "--num_gpus", "7", "--strict", "a b")
    assert args.num_accelerators == 2 and not args.strict
    assert args.user_script == "train.py" and args.user_args == ["--num_gpus", "7", "--strict", "a b"]


def test_program_argv() -> None:
    boot = ("py", "-u", "-m", "ds_recycle.launcher.bootstrap")
    assert Program("t.py", ("--x",), python="py").argv(3) == (*boot, "t.py", "--local_rank=3", "--x")
    assert Program("pkg.t", module=True, pass_local_rank=False, python="py").argv(0) == (*boot, "-m", "pkg.t")
    assert Program("./run.sh", ("1",), no_python=True).argv(1) == ("./run.sh", "--local_rank=1", "1")
    with pytest.raises(ValueError, match="--module and --no_python"):
        Program("x", module=True, no_python=True)


def test_worker_env_contract() -> None:
    job = JobSpec(TWO_NODES, 1, "10.0.0.1", 4242, Program("t.py"), base_env={"HOME": "/h", "MKL_NUM_THREADS": "8"})
    env = worker_env(job, 3)
    expected = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4242", "RANK": "3", "LOCAL_RANK": "1",
                "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "LOCAL_SIZE": "2", "CROSS_RANK": "1",
                "TORCHELASTIC_USE_AGENT_STORE": "True", "DS_RECYCLE_STORE": "10.0.0.1:4242",
                "DS_RECYCLE_LAUNCHER": "1", "DS_RECYCLE_RESTART_COUNT": "0", "DS_RECYCLE_LOST_EXIT_CODE": "75",
                "CUDA_VISIBLE_DEVICES": "1,3", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "DS_ACCELERATOR": "cpu", "HOME": "/h"}
    assert {k: env[k] for k in expected} == expected
    assert [s.rank for s in worker_specs(job)] == [2, 3]


def test_workers_get_the_nccl_settings_that_keep_survivors_alive_unless_the_user_set_them() -> None:
    env = worker_env(JobSpec(TWO_NODES, 0, "h", 1, Program("t.py"), base_env={}, cuda_available=True), 0)
    assert {k: env[k] for k in NCCL_ENV} == dict(NCCL_ENV) and NCCL_ENV["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert NCCL_ENV["NCCL_LAUNCH_ORDER_IMPLICIT"] == "1"  # the epoch's communicators run in the host's one order
    base = {"NCCL_NVLS_ENABLE": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    env = worker_env(JobSpec(TWO_NODES, 0, "h", 1, Program("t.py"), base_env=base, cuda_available=True), 0)
    assert env["NCCL_NVLS_ENABLE"] == "1" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "0"


def test_slots_map_through_the_launchers_visible_devices() -> None:
    def visible(base: dict[str, str]) -> str:
        return worker_env(JobSpec(TWO_NODES, 1, "h", 1, Program("t.py"), base_env=base), 2)["CUDA_VISIBLE_DEVICES"]
    assert visible({}) == "1,3"
    assert visible({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == "5,7"  # slot i is the i-th device the launcher sees
    assert visible({"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}) == "1,3"
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=4,5 shows 2"):
        visible({"CUDA_VISIBLE_DEVICES": "4,5"})


def test_user_thread_and_accelerator_settings_win() -> None:
    base = {"OMP_NUM_THREADS": "4", "DS_ACCELERATOR": "cuda"}
    env = worker_env(JobSpec(TWO_NODES, 0, "h", 1, Program("t.py"), base_env=base), 0)
    assert env["OMP_NUM_THREADS"] == "4" and "MKL_NUM_THREADS" not in env and env["DS_ACCELERATOR"] == "cuda"
    env = worker_env(JobSpec(TWO_NODES, 0, "h", 1, Program("t.py"), threads_per_worker=None, base_env={},
                             cuda_available=True), 0)
    assert "OMP_NUM_THREADS" not in env and "DS_ACCELERATOR" not in env


def test_one_thread_per_worker_by_default_on_cpu_only() -> None:
    assert cli.build_job(_args("t.py"), 1, cuda_devices=0).threads_per_worker == 1
    assert cli.build_job(_args("t.py"), 1, cuda_devices=2).threads_per_worker is None
    assert cli.build_job(_args("--threads_per_worker", "2", "t.py"), 1, cuda_devices=2).threads_per_worker == 2
    assert cli.build_job(_args("--threads_per_worker", "0", "t.py"), 1, cuda_devices=0).threads_per_worker is None


def test_log_ranks_hide_stdout_only() -> None:
    job = cli.build_job(_args("--num_accelerators", "3", "--log_ranks", "0,2", "t.py"), 29500, cuda_devices=0)
    assert [(s.rank, s.show_stdout, s.prefix) for s in worker_specs(job)] == [
        (0, True, "[rank 0] "), (1, False, "[rank 1] "), (2, True, "[rank 2] ")]


@pytest.mark.parametrize("argv, message", [
    (["--log_ranks", "0,x", "t.py"], "--log_ranks"),
    (["--num_gpus", "2", "--log_ranks", "0,2", "t.py"], r"ranks 0\.\.1"),
    (["--threads_per_worker", "-1", "t.py"], "--threads_per_worker -1"),
    (["--node_rank", "1", "t.py"], "--node_rank 1 needs --no_ssh"),
    (["--no_ssh", "--node_rank", "1", "--master_port", "0", "t.py"], "give node 0's actual store port"),
    (["--error_grace", "-2", "t.py"], "error_grace_s=-2"),
    (["--include", "localhost:0", "--num_gpus", "1", "t.py"], "cannot be combined"),
    (["--num_gpus", "1", "missing.py"], "'missing.py' does not exist"),
])
def test_bad_options_are_named(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cli.build_job(_args(*argv), 29500, cuda_devices=0)


def test_remote_launcher_command_reproduces_the_options(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=4\n")
    args = _args("--hostfile", str(hostfile), "--include", "worker-0@worker-1:1,3", "--strict", "--log_ranks", "0",
                 "--restart_failed_after", "2", "--no_local_rank", "train.py", "--cfg", "a b.json")
    job = cli.build_job(args, 4321, cuda_devices=0)
    assert job.master_addr == "worker-0" and job.layout == TWO_NODES
    argv = launcher_argv(job, 1)
    remote = _args(*argv[argv.index("launch") + 1:])
    again = cli.build_job(remote, 4321, cuda_devices=0)
    assert again.node_rank == 1 and list(again.local_ranks) == [2, 3]
    assert (again.layout, again.master_addr, again.policy, again.program.args, again.log_ranks) == \
        (job.layout, job.master_addr, job.policy, job.program.args, job.log_ranks)
    assert not again.program.pass_local_rank

    ssh = ssh_command(job, 1, "/work dir", {"PYTHONPATH": "/src"}, ssh_port=2222)
    assert ssh[:6] == ["ssh", "-o", "BatchMode=yes", "-p", "2222", "worker-1"]
    cd, _, remote_shell = ssh[6].partition(" && ")
    assert shlex.split(cd) == ["cd", "/work dir"]
    assert shlex.split(remote_shell) == ["env", "PYTHONPATH=/src", *argv]


def test_exported_env(tmp_path: Path) -> None:
    env_file = tmp_path / ".deepspeed_env"
    env_file.write_text("NCCL_X=1\n# comment\nFOO=bar=baz\n")
    env = {"PYTHONPATH": "/p", "DS_ACCELERATOR": "cpu", "HOME": "/h", "CUDA_VISIBLE_DEVICES": "0",
           "DS_RECYCLE_STORE": "x:1", "OMP_NUM_THREADS": "1", "DS_RECYCLE_CHECK_ORDER": "1"}
    assert exported_env(env, (env_file,)) == {"PYTHONPATH": "/p", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                                              "DS_RECYCLE_CHECK_ORDER": "1", "NCCL_X": "1", "FOO": "bar=baz"}


def test_multi_host_needs_a_reachable_master_addr(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\nworker-1 slots=1\n")
    with pytest.raises(ValueError, match="cannot reach node 0"):
        cli.build_job(_args("--hostfile", str(hostfile), "t.py"), 1, cuda_devices=0)


def test_dry_run_prints_layout_and_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ds_recycle.cli import main
    hostfile = tmp_path / "hosts"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=1\n")
    assert main(["launch", "--dry_run", "--hostfile", str(hostfile), "--master_port", "0", "t.py", "--x"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["node 0: worker-0 slots [0, 1] ranks 0..1", "node 1: worker-1 slots [0] ranks 2..2"]
    assert out[2].startswith("rank 0: ") and out[2].endswith("-u -m ds_recycle.launcher.bootstrap t.py --local_rank=0 --x")
    assert out[4].startswith("node 1 on worker-1: ssh -o BatchMode=yes worker-1 ")


def test_bad_hostfile_exits_2_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ds_recycle.cli import main
    hostfile = tmp_path / "hosts"
    hostfile.write_text("worker-0 slots=two\n")
    assert main(["launch", "--hostfile", str(hostfile), "t.py"]) == 2
    assert "is not 'HOST slots=N'" in capsys.readouterr().err


def test_busy_port_exits_2_and_suggests_port_0(capsys: pytest.CaptureFixture[str]) -> None:
    from datetime import timedelta

    from torch.distributed import TCPStore

    from ds_recycle.cli import main
    busy = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5), wait_for_workers=False)
    assert main(["launch", "--master_port", str(busy.port), "t.py"]) == 2
    assert "--master_port 0" in capsys.readouterr().err


def test_too_few_visible_devices_is_an_option_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    with pytest.raises(ValueError, match="need 2 devices"):
        cli.build_job(_args("--num_gpus", "2", "t.py"), 1, cuda_devices=0)


@pytest.mark.parametrize(("extra", "message"), [
    (["--store", "http://h1:2379"], r"give etcd://HOST:PORT"),
    (["--store", "etcd://h1:2379,h2"], r"'h2' in .*give host:port"),
    (["--store", "etcd://h1:2379", "--store_service"], "name two stores"),
])
def test_bad_etcd_store_is_an_option_error_naming_the_fix(extra: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cli.build_job(_args(*extra, "t.py"), 1, cuda_devices=0)


def test_etcd_store_reaches_the_workers_with_its_namespace(tmp_path: Path) -> None:
    job = cli.build_job(_args("--store", "etcd://h1:2379, h2:2380", "t.py"), 1, cuda_devices=0)
    assert job.store == "etcd://h1:2379,h2:2380/ds-recycle"
    env = worker_env(job, 0)
    assert env["DS_RECYCLE_STORE"] == job.store and env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    hostfile = tmp_path / "hosts"
    hostfile.write_text("worker-0 slots=1\nworker-1 slots=1\n")
    several = cli.build_job(_args("--hostfile", str(hostfile), "--store", "etcd://h1:2379/j", "t.py"), 1,
                            cuda_devices=0)
    argv = launcher_argv(several, 1)  # the other nodes' launchers (over ssh) use the same etcd namespace
    assert argv[argv.index("--store") + 1] == "etcd://h1:2379/j"

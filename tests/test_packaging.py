"""The installed package: one ``deltafleet`` namespace (no top-level ``train``, ``kernels``, ... that
would clash with other distributions), the Hydra configs shipped inside it, and the ``deltafleet``
command. The wheel is built from a copy of the checkout's files (``pip wheel --no-deps``) and run
from a folder outside the checkout."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.split("\n")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)],
                           capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stdout + built.stderr
    (whl,) = out.glob("deltafleet-*.whl")
    return whl


def test_the_wheel_holds_one_namespace_and_the_configs(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"deltafleet", wheel.name.split("-py")[0] + ".dist-info"}, tops
    for sub in ("train", "merge", "compress", "serve", "kernels"):
        assert f"deltafleet/{sub}/__init__.py" in names
    configs = sorted(str(p.relative_to(REPO)) for p in (REPO / "conf").rglob("*.yaml"))
    assert len(configs) > 30
    assert {f"deltafleet/{c}" for c in configs} <= set(names)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "deltafleet = deltafleet.cli:main" in entry_points


def test_the_installed_command_runs_outside_the_checkout(wheel, tmp_path):
    """The wheel unpacked into a folder of its own (its dependencies from this environment), run from
    elsewhere: ``deltafleet --help`` lists the jobs, ``deltafleet serve --cfg job`` composes from the
    shipped configs, and the job folders are not top-level modules."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}

    def run(*args):
        return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)

    helped = run("-m", "deltafleet", "--help")
    assert helped.returncode == 0, helped.stderr
    for job in ("real-base", "train", "export", "distill", "eval", "serve", "merge", "bench"):
        assert f"\n  {job} " in helped.stdout
    job_help = run("-m", "deltafleet", "serve", "--help")  # Hydra's, named as typed, not after run.py
    assert job_help.returncode == 0 and job_help.stdout.startswith("deltafleet serve is powered by Hydra."), \
        job_help.stdout[:200] + job_help.stderr[-2000:]
    # found by a fresh user: a benchmark's help listed the training's config groups (trainer, variant, …)
    bench_help = run("-m", "deltafleet", "bench", "serve", "--help")
    assert bench_help.returncode == 0, bench_help.stderr[-2000:]
    assert bench_help.stdout.splitlines()[2].startswith("Settings (conf/bench_serve.yaml; override any as key=value")
    assert "Configuration groups" not in bench_help.stdout and "\ntrainer:" not in bench_help.stdout
    assert "\nconcurrency:\n- 1\n" in bench_help.stdout  # its own settings, as composed
    for job in ("export", "distill"):
        choose = run("-m", "deltafleet", job, "--help")
        assert choose.returncode == 2 and "Traceback" not in choose.stderr, choose.stderr[-2000:]
        assert choose.stderr.startswith(f"deltafleet {job}: You must specify 'variant'")
        assert f"e.g. `deltafleet {job} variant=coder --help`" in choose.stderr
        chosen = run("-m", "deltafleet", job, "variant=coder", "--help")
        assert chosen.returncode == 0 and chosen.stdout.startswith(f"deltafleet {job} is powered by Hydra.")
    plain_help = run("-m", "deltafleet", "summary", "--help")  # not a Hydra job: no Hydra override added
    said = plain_help.stdout + plain_help.stderr
    assert said.startswith("usage: ") and "hydra" not in said, said[-2000:]
    composed = run("-m", "deltafleet", "serve", "--cfg", "job", "port=9123")
    assert composed.returncode == 0, composed.stderr
    assert "port: 9123" in composed.stdout and "max_request_bytes: 2097152" in composed.stdout
    real = run("-m", "deltafleet", "real-base", "--cfg", "job", "max_perplexity=9")
    assert real.returncode == 0 and "max_perplexity: 9" in real.stdout, real.stderr
    where = run("-c", "import deltafleet.serve.run as m; print(m.__file__)")
    assert where.stdout.strip() == str(site / "deltafleet" / "serve" / "run.py")
    for name in ("train", "serve"):
        missing = run("-c", f"import {name}")
        assert missing.returncode != 0 and f"No module named '{name}'" in missing.stderr
    # `kernels` is Hugging Face's distribution's name (transformers >= 5.25 requires it): never the wheel's
    found = run("-c", "import importlib.util as u; s = u.find_spec('kernels'); print(s and s.origin)")
    assert found.returncode == 0, found.stderr
    assert not found.stdout.strip().startswith(str(site)), found.stdout


def _import_kernels_at_the_root(*flags: str, pythonpath: str | None = None) -> list[str]:
    """Import the top-level name ``kernels`` from a process whose cwd is the checkout's root (where
    ``kernels/`` is importable under that name); print where it came from and what it holds."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    code = ("import kernels, sys; print(kernels.__file__); print(hasattr(kernels, 'bitdelta_linear')); "
            "print(sys.modules['kernels'] is kernels)")
    out = subprocess.run([sys.executable, *flags, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout.split()


def test_the_checkout_root_steps_aside_for_an_installed_kernels(tmp_path):
    """Another distribution named ``kernels`` (Hugging Face's, which transformers imports) wins over
    the checkout's ``kernels/`` folder even with the root first on ``sys.path``."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    path, has_dispatcher, registered = _import_kernels_at_the_root(pythonpath=str(tmp_path))
    assert Path(path) == tmp_path / "kernels" / "__init__.py"
    assert has_dispatcher == "False" and registered == "True"


def test_the_checkout_root_without_a_kernels_distribution_gives_an_empty_module():
    """With no other ``kernels`` to load (-S: no site-packages), the top-level name is an empty module:
    none of deltafleet's kernels, nothing imported, so transformers' availability check says no."""
    path, has_dispatcher, _ = _import_kernels_at_the_root("-S")
    assert Path(path) == REPO / "kernels" / "__init__.py"
    assert has_dispatcher == "False"


def test_transformers_loads_a_model_class_from_the_checkout_root():
    """transformers ≥ 5.25 imports ``from kernels import CUDAProperties, …`` when a model module loads;
    run from the checkout's root, that import must reach the installed distribution (or none)."""
    code = "from transformers import LlamaForCausalLM; import deltafleet.kernels as k; print(k.bitdelta_linear.__module__)"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["deltafleet.kernels.linear"]

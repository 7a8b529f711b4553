"""The Docker image runs for its own non-root user.

A base image whose / was mode 0700 (the `mktemp -d` directory it was debootstrapped into) gave an
image whose user could reach neither /bin nor /opt/venv/bin: every container failed with
`exec: "flower-superlink": executable file not found`. These checks run the image's entry points as
its default (non-root) user, and check that the image is CPU-only and carries no wheels.

Slow, and skipped unless a Docker daemon answers and the image exists: build it with
`docker/build-and-run.sh` (or `docker build -t fedpower:local .`). FEDPOWER_IMAGE names another tag.
"""

import json
import os
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.slow
IMAGE = os.environ.get("FEDPOWER_IMAGE", "fedpower:local")
MAX_SIZE = 2 * 1024**3  # under 2 GB (the image was 6 GB with the wheels in a layer)

# One container for all the checks: with the vfs storage driver each container start copies the image.
PROBE = r"""
echo "uid=$(id -u)"
echo "user=$(id -un)"
echo "root-mode=$(stat -c %a /)"
for cmd in flower-superlink flower-supernode fedpower-run; do
    if out=$("$cmd" --help 2>&1); then echo "help:$cmd=0"; else echo "help:$cmd=$?"; echo "$out" | tail -5 | sed 's/^/  | /'; fi
done
# /usr/share/python-wheels: Debian's python3-venv (pip, setuptools for ensurepip), part of the base.
echo "wheels=$(find / -xdev -path /usr/share/python-wheels -prune -o -name '*.whl' -print 2>/dev/null | wc -l)"
echo "app-tests=$(test -e /app/tests && echo yes || echo no)"
echo "app-docker=$(test -e /app/docker && echo yes || echo no)"
python -c "import torch; print('torch-cuda=%s' % torch.version.cuda)"
echo "nvidia=$(pip list 2>/dev/null | grep -ciE '^(nvidia-|triton )')"
echo "pip-cache=$(ls -d "$HOME/.cache/pip" /app/.cache/pip /tmp/pip-* 2>/dev/null | wc -l)"
echo "app-writable=$(touch /app/.flwr/.probe /app/outputs/.probe 2>/dev/null && echo yes || echo no)"
"""


def _docker(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def image() -> dict:
    if shutil.which("docker") is None:
        pytest.skip("docker is not installed")
    try:
        info = _docker("info", "--format", "{{.ServerVersion}}")
    except subprocess.TimeoutExpired:
        pytest.skip("the Docker daemon does not answer (docker info timed out)")
    if info.returncode != 0:
        pytest.skip(f"no Docker daemon reachable: {(info.stderr or info.stdout).strip()[:200]}")
    inspect = _docker("image", "inspect", IMAGE)
    if inspect.returncode != 0:
        pytest.skip(f"image {IMAGE} is not built (docker/build-and-run.sh builds it; FEDPOWER_IMAGE names another)")
    return json.loads(inspect.stdout)[0]


@pytest.fixture(scope="module")
def probe(image) -> dict:
    run = _docker("run", "--rm", "--network=none", IMAGE, "sh", "-c", PROBE, timeout=900)
    hint = ("\nthe image's user cannot reach / or /bin: a base rootfs at mode 0700?"
            if "executable file not found" in run.stderr else "")
    assert run.returncode == 0, f"the probe container failed ({run.returncode}): {run.stdout}\n{run.stderr}{hint}"
    found = dict(line.split("=", 1) for line in run.stdout.splitlines() if "=" in line and not line.startswith("  |"))
    found["_stdout"] = run.stdout
    return found


def test_image_runs_as_non_root_user(image, probe):
    assert image["Config"]["User"] not in ("", "root", "0"), "the image must not run as root"
    assert probe["uid"] != "0", probe["_stdout"]
    assert probe["app-writable"] == "yes", "the image's user cannot write /app/.flwr (FLWR_HOME) or /app/outputs"


def test_root_directory_is_not_private(probe):
    assert probe["root-mode"] != "700", f"/ is mode {probe['root-mode']}: the non-root user cannot reach /bin"
    assert int(probe["root-mode"], 8) & 0o005 == 0o005, f"/ is mode {probe['root-mode']}: others need r-x"


@pytest.mark.parametrize("cmd", ["flower-superlink", "flower-supernode", "fedpower-run"])
def test_entry_point_help_runs_as_image_user(probe, cmd):
    assert probe.get(f"help:{cmd}") == "0", f"`{cmd} --help` failed as user {probe.get('user')}:\n{probe['_stdout']}"


def test_image_is_cpu_only_and_carries_no_wheels(image, probe):
    assert probe["torch-cuda"] == "None", "a CUDA build of torch is in the image"
    assert probe["nvidia"] == "0", "nvidia-*/triton packages are in the image"
    assert probe["wheels"] == "0", "wheel files are in the image"
    assert probe["app-tests"] == "no" and probe["app-docker"] == "no", "tests/ or docker/ were copied into /app"
    assert probe["pip-cache"] == "0", "a pip cache is in the image"
    assert image["Size"] < MAX_SIZE, f"image is {image['Size'] / 1e9:.2f} GB, over the 2 GiB target"

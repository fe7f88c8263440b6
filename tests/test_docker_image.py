"""The Docker image, built and run for real: skipped where no Docker daemon answers (as in CI), or
where the base image is neither in the local image store nor pullable (no registry reachable).

`--demo` serves /health and chat completions as the non-root uid 10001 and as an arbitrary uid
in group 0, the HEALTHCHECK turns healthy, the HF cache is a volume both can write, `docker stop`
with streams in flight ends each stream cleanly and the exit code is 0 (not SIGKILL's 137), and
Triton's launcher toolchain (a C compiler, Python's headers) is in the image.

Where the default base cannot be pulled, GEMMA4SERVE_TEST_BASE_IMAGE names another one (passed as
--build-arg BASE_IMAGE); README.md ("Docker") says how the image was verified without a registry.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid

import httpx
import openai
import pytest
from fake_engine import REPO_ROOT, sse_data

pytestmark = pytest.mark.timeout(1800)  # the first build downloads torch (minutes)

TAG = "gemma4serve:test"
MODEL = "gemma4serve-demo"
BASE_IMAGE_ENV = "GEMMA4SERVE_TEST_BASE_IMAGE"
ARBITRARY_USER = "12345:0"
NUM_STREAMS = 4
PULL_TIMEOUT_S = 300  # the default base is about 100 MB


def docker(*args: str, timeout: float = 120, check: bool = True) -> str:
    result = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, env=_docker_env()
    )
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout.strip()


def _docker_env() -> dict[str, str]:
    env = dict(os.environ)
    if _buildx_missing():
        env["DOCKER_BUILDKIT"] = "0"  # a client without buildx builds with the classic builder
    return env


_buildx: list[bool] = []


def _buildx_missing() -> bool:
    if not _buildx:
        probe = subprocess.run(["docker", "buildx", "version"], capture_output=True, timeout=30)
        _buildx.append(probe.returncode != 0)
    return _buildx[0]


def daemon_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        probe = subprocess.run(["docker", "info"], capture_output=True, timeout=20)
    except subprocess.TimeoutExpired:
        return False
    return probe.returncode == 0


def base_image() -> str:
    """The base the build starts from: GEMMA4SERVE_TEST_BASE_IMAGE, else the Dockerfile's
    `ARG BASE_IMAGE=` default."""
    if base := os.environ.get(BASE_IMAGE_ENV):
        return base
    for line in (REPO_ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("ARG BASE_IMAGE="):
            return line.removeprefix("ARG BASE_IMAGE=").strip()
    raise AssertionError("the Dockerfile declares no `ARG BASE_IMAGE=` default")


def base_image_unavailable(base: str) -> str | None:
    """Why the build could not get `base` (None when it can): it is not in the local image store
    and pulling it failed (no registry reachable)."""
    if subprocess.run(["docker", "image", "inspect", base], capture_output=True).returncode == 0:
        return None
    try:
        pull = subprocess.run(
            ["docker", "pull", base], capture_output=True, text=True, timeout=PULL_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        failure = f"no answer in {PULL_TIMEOUT_S} s"
    else:
        if pull.returncode == 0:
            return None
        failure = (pull.stderr.strip() or pull.stdout.strip() or "no message").splitlines()[-1]
    return (
        f"the base image {base} is not present locally and could not be pulled ({failure}); "
        f"set {BASE_IMAGE_ENV} to a local image"
    )


@pytest.fixture(scope="module")
def image() -> str:
    if not daemon_answers():
        pytest.skip("no Docker daemon answers here")
    base = base_image()
    if reason := base_image_unavailable(base):
        pytest.skip(reason)
    build_args = ["--build-arg", f"BASE_IMAGE={base}"]
    docker("build", "-t", TAG, *build_args, str(REPO_ROOT), timeout=1500)
    return TAG


@pytest.fixture(scope="module")
def hf_volume(image):
    name = f"gemma4serve-test-hf-{uuid.uuid4().hex[:8]}"
    docker("volume", "create", name)
    yield name
    docker("volume", "rm", "-f", name, check=False)


class Container:
    """`docker run -d` of the image with `--demo`, port 8000 published on a loopback port."""

    def __init__(self, image: str, *run_args: str):
        self.id = docker(
            "run", "-d", "-p", "127.0.0.1::8000", *run_args, image, "--demo", timeout=60
        )
        try:
            self.wait_ready()
        except AssertionError:
            self.remove()  # the caller never gets it to clean up
            raise
        self.url = "http://" + docker("port", self.id, "8000/tcp").splitlines()[0]

    def wait_ready(self, patience: float = 300) -> None:
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            logs = self.logs()
            if "gemma4serve ready:" in logs:
                return
            if self.inspect()["State"]["Status"] == "exited":
                break
            time.sleep(1)
        raise AssertionError(f"the container never said it was ready:\n{self.logs()[-6000:]}")

    def logs(self) -> str:
        result = subprocess.run(
            ["docker", "logs", self.id], capture_output=True, text=True, timeout=60
        )
        return result.stdout + result.stderr

    def inspect(self) -> dict:
        return json.loads(docker("inspect", self.id))[0]

    def exec(self, *command: str) -> str:
        return docker("exec", self.id, *command)

    def remove(self) -> None:
        docker("rm", "-f", self.id, check=False)


@pytest.fixture
def containers():
    started: list[Container] = []
    yield started
    for container in started:
        container.remove()


def chat_completion_works(container: Container) -> None:
    assert httpx.get(container.url + "/health", timeout=30).status_code == 200
    client = openai.OpenAI(base_url=container.url + "/v1", api_key="unused", max_retries=0)
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 8


def stop_with_streams_in_flight(container: Container) -> list[list[str] | str]:
    """Starts NUM_STREAMS long streams, `docker stop`s the container (its default 10 s grace)
    once each has its first chunk, and returns every stream's `data:` payloads (or the error
    that cut it)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 4000,  # outlasts the drain on CPU: the drain's abort must end them cleanly
        "ignore_eos": True,
        "stream": True,
    }
    all_started = threading.Barrier(NUM_STREAMS + 1, timeout=120)
    results: dict[int, list[str] | str] = {}

    def stream(index: int) -> None:
        try:
            with httpx.stream(
                "POST", container.url + "/v1/chat/completions", json=body, timeout=120
            ) as response:
                lines = response.iter_lines()
                first = next(lines)
                all_started.wait()
                results[index] = sse_data([first, *lines])
        except Exception as error:  # reported by the caller's assertion
            results[index] = f"{type(error).__name__}: {error}"

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(NUM_STREAMS)]
    for thread in threads:
        thread.start()
    all_started.wait()
    docker("stop", container.id, timeout=60)
    for thread in threads:
        thread.join(60)
    return [results.get(i, "never ended") for i in range(NUM_STREAMS)]


def assert_streams_ended_cleanly(streams: list[list[str] | str]) -> None:
    for payloads in streams:
        assert isinstance(payloads, list) and payloads[-1] == "[DONE]", (
            f"a stream was cut: {payloads}"
        )
        finish = json.loads(payloads[-2])["choices"][0]["finish_reason"]
        assert finish in ("length", "abort"), finish


def test_demo_serves_as_non_root_turns_healthy_and_stops_cleanly(image, hf_volume, containers):
    container = Container(image, "--health-interval", "1s", "-v", f"{hf_volume}:/cache/huggingface")
    containers.append(container)
    chat_completion_works(container)

    assert container.exec("id", "-u") == "10001" and container.exec("id", "-g") == "0"
    deadline = time.monotonic() + 120
    while container.inspect()["State"]["Health"]["Status"] == "starting":
        assert time.monotonic() < deadline, "the HEALTHCHECK never ran"
        time.sleep(1)
    assert container.inspect()["State"]["Health"]["Status"] == "healthy"

    (mount,) = [
        m for m in container.inspect()["Mounts"] if m["Destination"] == "/cache/huggingface"
    ]
    assert mount["Type"] == "volume" and mount["Name"] == hf_volume
    container.exec("touch", "/cache/huggingface/written-by-10001")

    assert_streams_ended_cleanly(stop_with_streams_in_flight(container))
    assert container.inspect()["State"]["ExitCode"] == 0


def test_an_arbitrary_uid_serves_the_demo_and_writes_the_hf_volume(image, hf_volume, containers):
    container = Container(image, "--user", ARBITRARY_USER, "-v", f"{hf_volume}:/cache/huggingface")
    containers.append(container)
    chat_completion_works(container)
    assert container.exec("id", "-u") == "12345"
    container.exec("touch", "/cache/huggingface/written-by-12345")

    assert_streams_ended_cleanly(stop_with_streams_in_flight(container))
    assert container.inspect()["State"]["ExitCode"] == 0
    # The volume outlives the container: a new one sees what this one wrote.
    listing = docker(
        "run", "--rm", "--entrypoint", "ls", "-v", f"{hf_volume}:/cache/huggingface",
        image, "/cache/huggingface",
    )  # fmt: skip
    assert "written-by-12345" in listing.split()


def test_triton_can_build_its_launcher(image):
    """Triton compiles a C launcher against Python's headers on a GPU's first kernel: the same
    build, of a trivial extension module, as the image's default user."""
    probe = (
        "import pathlib, subprocess, sys, sysconfig, tempfile\n"
        "tmp = pathlib.Path(tempfile.mkdtemp())\n"
        "(tmp / 'probe.c').write_text('#include <Python.h>\\n'\n"
        "    'static struct PyModuleDef m = {PyModuleDef_HEAD_INIT, \"probe\"};\\n'\n"
        "    'PyMODINIT_FUNC PyInit_probe(void) { return PyModule_Create(&m); }\\n')\n"
        "so = tmp / ('probe' + sysconfig.get_config_var('EXT_SUFFIX'))\n"
        "subprocess.run(['cc', '-shared', '-fPIC', '-I', sysconfig.get_paths()['include'],\n"
        "    str(tmp / 'probe.c'), '-o', str(so)], check=True)\n"
        "sys.path.insert(0, str(tmp)); import probe; print('built', probe.__name__)\n"
    )
    assert docker("run", "--rm", "--entrypoint", "python", image, "-c", probe) == "built probe"


# ---- the skip rule, against a stand-in `docker` (these run everywhere) --------------------------

OFFLINE_PULL = (
    'Error response from daemon: Get "https://registry-1.docker.io/v2/": '
    "dial tcp: lookup registry-1.docker.io: no such host"
)


@pytest.fixture
def fake_docker(tmp_path, monkeypatch):
    """A `docker` on PATH whose daemon answers; `image inspect` and `pull` exit with
    $FAKE_INSPECT_RC and $FAKE_PULL_RC (a pull that fails says what an offline daemon says);
    every call is logged to the returned file."""
    calls = tmp_path / "calls"
    script = tmp_path / "bin" / "docker"
    script.parent.mkdir()
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{calls}"\n'
        'case "$1 $2" in\n'
        '  "info "*|"buildx version") exit 0 ;;\n'
        '  "image inspect") exit "$FAKE_INSPECT_RC" ;;\n'
        f'  "pull "*) [ "$FAKE_PULL_RC" = 0 ] || echo \'{OFFLINE_PULL}\' >&2; '
        'exit "$FAKE_PULL_RC" ;;\n'
        "  *) exit 99 ;;\n"
        "esac\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    calls.touch()
    return calls


@pytest.mark.parametrize(
    ("inspect_rc", "pull_rc", "available"), [(0, 1, True), (1, 0, True), (1, 1, False)]
)
def test_skip_rule_is_the_base_image_local_or_pullable(
    fake_docker, monkeypatch, inspect_rc, pull_rc, available
):
    monkeypatch.setenv("FAKE_INSPECT_RC", str(inspect_rc))
    monkeypatch.setenv("FAKE_PULL_RC", str(pull_rc))
    reason = base_image_unavailable("local/base:1")
    if available:
        assert reason is None
    else:
        assert "local/base:1 is not present locally" in reason and "no such host" in reason
        assert BASE_IMAGE_ENV in reason
    pulled = "pull local/base:1" in fake_docker.read_text().splitlines()
    assert pulled == (inspect_rc != 0)  # a local base is never pulled


def test_skip_rule_reads_the_base_from_the_env_or_the_dockerfile(monkeypatch):
    monkeypatch.setenv(BASE_IMAGE_ENV, "local/base:1")
    assert base_image() == "local/base:1"
    monkeypatch.delenv(BASE_IMAGE_ENV)
    default = base_image()
    assert f"ARG BASE_IMAGE={default}\n" in (REPO_ROOT / "Dockerfile").read_text()
    assert default.startswith("nvidia/cuda:")


def test_skip_rule_skips_the_image_tests_without_building(fake_docker, monkeypatch):
    """With a daemon that answers but no base image to be had, the image tests skip (not error)
    and nothing is built."""
    monkeypatch.setenv("FAKE_INSPECT_RC", "1")
    monkeypatch.setenv("FAKE_PULL_RC", "1")
    monkeypatch.setenv(BASE_IMAGE_ENV, "local/base:1")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         "-k", "not test_skip_rule", __file__],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 0 and "3 skipped" in done.stdout, done.stdout + done.stderr
    assert "local/base:1 is not present locally" in done.stdout
    assert not any(call.startswith("build") for call in fake_docker.read_text().splitlines())

"""The README's offline example runs as written, with no network, and writes the demo model where
the README says `gemma4serve --demo` keeps it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from fake_engine import REPO_ROOT

from gemma4serve.demo.checkpoints import DEMO_VERSION

pytestmark = pytest.mark.timeout(300)

WHERE = "$GEMMA4SERVE_CACHE/demo-v1/{target,assistant} (default ~/.cache/gemma4serve)"


def offline_example() -> str:
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("\n## Offline API\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "the README's Offline API section has no python block"
    return match.group(1)


def test_the_offline_example_runs_offline_and_says_where_the_demo_lives(tmp_path):
    code = offline_example()
    assert WHERE in code and f"/{DEMO_VERSION}/" in WHERE
    # a few tokens each: every call runs as written, in seconds on CPU
    code, shortened = re.subn(r"max_tokens=\d+", "max_tokens=4", code)
    assert shortened == 2
    unreachable = "http://127.0.0.1:9"  # any download attempt fails at once
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "GEMMA4SERVE_CACHE": str(tmp_path / "cache"),
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "HTTP_PROXY": unreachable,
        "HTTPS_PROXY": unreachable,
        "ALL_PROXY": unreachable,
    }
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in ("target", "assistant"):
        assert (tmp_path / "cache" / DEMO_VERSION / name / "config.json").is_file()
    assert not (tmp_path / "hf").exists(), "the example touched the Hugging Face cache"

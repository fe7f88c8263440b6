"""Schema-driven fuzzing: schemathesis generates requests from the server's own /openapi.json
(valid ones and ones that break the schema) and sends them to the real server, serving the tiny
demo Gemma 4 with its MTP assistant on CPU. No request may get a 5xx, and the KV pages all come
back. Bounded: a fixed number of examples per operation, a small context and few choices, so that
every generation is short."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from fake_engine import free_pages, wait_for_free_pages
from hypothesis import HealthCheck, settings
from test_server_real import start_server

pytestmark = pytest.mark.timeout(600)

EXAMPLES_PER_OPERATION = 80


@pytest.fixture(scope="module")
def server(demo_root):
    _, target, assistant = demo_root
    # Generations stay short: at most 64 positions and 2 choices a request.
    with start_server(target, assistant, "--max-model-len", "64", "--max-n", "2") as proc:
        yield proc


@pytest.fixture(scope="module")
def idle_pages(server):
    return free_pages(server)


@pytest.fixture(scope="module")
def api_schema(server, idle_pages):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,  # the same examples every run: CI stays reproducible
    suppress_health_check=list(HealthCheck),
)
def test_no_request_gets_a_5xx(case, server):
    response = case.call(base_url=server.url, timeout=120)
    assert response.status_code < 500, (
        f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}\n"
        f"body: {str(case.body)[:500]}"
    )


def test_kv_pages_come_back_after_the_fuzzing(server, idle_pages):
    wait_for_free_pages(server, idle_pages)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200

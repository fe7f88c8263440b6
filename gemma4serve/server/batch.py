"""Batched prompts on /v1/completions: one engine request per prompt, their outputs merged into one
stream of RequestOutputs whose choices are indexed prompt-major (index = prompt * n + choice), as
OpenAI indexes them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from gemma4serve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


async def merged_outputs(
    streams: list[AsyncIterator[RequestOutput]], n: int, request_id: str
) -> AsyncIterator[RequestOutput]:
    """Every output carries every choice's totals; only the choices of the prompt that just moved
    carry new text, tokens and logprobs. The first output comes once every prompt's request was
    accepted, so a refused prompt fails the whole request before anything is sent. Ends early
    (without a finished output) when a request's stream does."""
    choices: dict[int, CompletionOutput] = {}  # by merged index, with nothing new
    latest: list[RequestOutput | None] = [None] * len(streams)
    pumps: list[asyncio.Task] = []

    def merged(news: list[tuple[int, RequestOutput]]) -> RequestOutput:
        """The batch after the prompts' new outputs `news` (prompt, output)."""
        fresh = {}
        for prompt, output in news:
            latest[prompt] = output
            for choice in output.outputs:
                index = prompt * n + choice.index
                fresh[index] = replace(choice, index=index)
                choices[index] = replace(
                    fresh[index], new_text="", new_token_ids=[], new_logprobs=None
                )
        outputs = [fresh.get(index, choice) for index, choice in sorted(choices.items())]
        done = [out for out in latest if out is not None]
        scored = [out.prompt_logprobs for out in done]
        complete = len(done) == len(streams) and all(s is not None for s in scored)
        return RequestOutput(
            request_id,
            done[0].prompt_token_ids,
            outputs,
            finished=len(done) == len(streams) and all(out.finished for out in done),
            metrics=_merged_metrics([out.metrics for out in done]),
            num_cached_tokens=sum(out.num_cached_tokens for out in done),
            # one list in prompt order; the response format splits it by prompt lengths
            prompt_logprobs=[entry for s in scored for entry in s] if complete else None,
        )

    try:
        yield merged([(prompt, await anext(stream)) for prompt, stream in enumerate(streams)])
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(prompt: int, stream) -> None:
            try:
                async for output in stream:
                    await queue.put((prompt, output))
                await queue.put((prompt, None))
            except Exception as e:
                await queue.put((prompt, e))

        running = {i for i, out in enumerate(latest) if not out.finished}
        pumps = [asyncio.create_task(pump(i, streams[i])) for i in running]
        while running:
            prompt, output = await queue.get()
            if isinstance(output, Exception):
                raise output
            if output is None:  # the stream ended
                if prompt in running:
                    return  # the engine stopped this request without a finished output
                continue
            if output.finished:
                running.discard(prompt)
            yield merged([(prompt, output)])
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # aborts a request that is still running


def _merged_metrics(metrics: list[RequestMetrics | None]) -> RequestMetrics | None:
    """The batch as one request: from the first arrival to the last finish."""
    if not metrics or any(m is None for m in metrics):
        return None

    def earliest(values):
        present = [v for v in values if v is not None]
        return min(present) if present else None

    finished = [m.finished_time for m in metrics]
    return RequestMetrics(
        arrival_time=min(m.arrival_time for m in metrics),
        first_scheduled_time=earliest(m.first_scheduled_time for m in metrics),
        first_token_time=earliest(m.first_token_time for m in metrics),
        finished_time=None if None in finished else max(finished),
    )

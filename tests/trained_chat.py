"""A tiny Gemma 4 taught, in a few seconds of Adam on CPU, to write known tool calls and thinking.

A random model never writes a tool call, so the chat-output tests overfit the tiny dense target
to a handful of fixed prompt -> completion pairs (teacher-forced cross-entropy on the completion
tokens) and save it as a checkpoint the real server loads, with the published Gemma 4 chat
template. Training stops once greedy decoding of every pair is certain (each completion token
wins by a margin), so the server's greedy output is exactly the completion written here. The MTP
assistant then learns the same completions, so that the server accepts its drafts.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gemma4serve.chat.arguments import QUOTE as Q

PUBLISHED_TEMPLATE = Path(__file__).parent / "data" / "chat_template.gemma-4-31B-it.jinja"
# A test-only addition: `open_thought` ends the prompt inside an open thought channel, as some
# versions of the official template do after a tool response.
OPEN_THOUGHT = "{%- if open_thought is defined and open_thought -%}<|channel>thought\n{%- endif -%}"

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string"},
        "filters": {
            "type": "object",
            "properties": {
                "max_price": {"type": "number"},
                "in_stock": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
        },
        "note": {"type": ["string", "null"]},
        "code": {"type": "string"},
    },
}
# Each request declares only the tool it needs: the declarations are most of a prompt's tokens.
WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
SEARCH_TOOLS = [{"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
THINK = {"enable_thinking": True}
NUM_DRAFT_TOKENS = 3  # the MTP server's --num-draft-tokens


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def call(name: str, notation: str) -> str:
    return f"<|tool_call>call:{name}{notation}<tool_call|>"


@dataclass
class Example:
    """A request (messages, tools, template kwargs) and the completion the model learns."""

    messages: list[dict]
    completion: str
    tools: list[dict] | None = field(default_factory=lambda: WEATHER_TOOLS)
    kwargs: dict = field(default_factory=dict)

    def create_kwargs(self, **fields) -> dict:
        """The arguments of the openai client's `chat.completions.create` for this request."""
        extra = {"extra_body": {"chat_template_kwargs": self.kwargs}} if self.kwargs else {}
        tools = {"tools": self.tools} if self.tools else {}
        return {"messages": self.messages, **tools, **extra, **fields}


# The agent loop's second turn: the history the openai SDK sends back after the first call
# (the assistant message as the server returned it, then the tool's result).
PARIS_REASONING = "I need the weather tool."
PARIS_ARGUMENTS = {"city": "Paris", "days": 1}
AGENT_HISTORY = [
    *user("Weather in Paris?"),
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": PARIS_REASONING,
        "reasoning": PARIS_REASONING,
        "tool_calls": [
            {
                "id": "call-1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(PARIS_ARGUMENTS)},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 C"},
]

EXAMPLES = {
    "single call": Example(
        user("Weather in Rome?"), call("get_weather", f"{{city:{Q}Rome{Q},days:3}}")
    ),
    "parallel calls": Example(
        user("Weather in Oslo and Lima?"),
        call("get_weather", f"{{city:{Q}Oslo{Q},days:2}}")
        + call("get_weather", f"{{city:{Q}Lima{Q},days:10}}"),
    ),
    "nested arguments": Example(
        user("Find a lamp."),
        call(
            "search",
            f"{{code:007,filters:{{in_stock:true,max_price:19.5,tags:[{Q}desk{Q},{Q}led{Q}]}},"
            f'note:null,query:{Q}lamp {{big}}: "red", a,b{Q}}}',
        ),
        tools=SEARCH_TOOLS,
    ),
    "thinking then answer": Example(
        user("What is two plus two?"),
        "<|channel>thought\nAdd two and two.<channel|>The answer is 4.",
        kwargs=THINK,
    ),
    "thinking then call": Example(
        user("Weather in Paris?"),
        f"<|channel>thought\n{PARIS_REASONING}<channel|>"
        + call("get_weather", f"{{city:{Q}Paris{Q},days:1}}"),
        kwargs=THINK,
    ),
    "agent answer": Example(
        AGENT_HISTORY,
        "<|channel>thought\nThe tool says sunny.<channel|>It is sunny in Paris, 21 C.",
        kwargs=THINK,
    ),
    "open channel": Example(
        user("Is the sea wide?"),
        "The sea is wide.<channel|>Yes, very wide.",
        kwargs={**THINK, "open_thought": True},
    ),
    "answer without tools": Example(user("Tell me a story."), "Once upon a time.", tools=None),
    "colon opener": Example(
        user("Weather in Kyiv?"), f"<|tool_call>:get_weather{{city:{Q}Kyiv{Q}}}<tool_call|>"
    ),
    "paren opener": Example(
        user("Weather in Baku?"),
        f"<|tool_call>call:get_weather(city:{Q}Baku{Q},days:2)<tool_call|>",
    ),
    "bare opener": Example(
        user("Weather in Cairo?"), f"Let me check.\ncall:get_weather{{city:{Q}Cairo{Q}}}"
    ),
}


def stop_text(example: Example) -> str:
    """What ends the turn: `<|tool_response>` after calls, else `<turn|>` (both stop tokens)."""
    calls = "call:get_weather" in example.completion or "call:search" in example.completion
    return "<|tool_response>" if calls else "<turn|>"


def render(tokenizer, example: Example) -> list[int]:
    """The prompt ids, rendered as the server renders a chat request."""
    from gemma4serve.server.protocol import ChatCompletionRequest

    body = {"messages": example.messages, "tools": example.tools}
    request = ChatCompletionRequest.model_validate(body)
    text = tokenizer.apply_chat_template(
        request.template_messages(), tools=example.tools, **example.kwargs
    )
    return tokenizer.encode(text)


def train_chat_checkpoint(out: Path, max_steps: int = 600) -> tuple[Path, Path]:
    """Write, train and save the target and its MTP assistant; returns both dirs."""
    from hf_oracle import load_hf_target

    from gemma4serve.demo.checkpoints import write_tiny_assistant, write_tiny_checkpoint
    from gemma4serve.tokenizer import Tokenizer

    torch.manual_seed(0)
    target = write_tiny_checkpoint(
        out / "target", "dense", release_format=False, dtype=torch.float32
    )
    assistant = write_tiny_assistant(out / "assistant", "dense")
    template = PUBLISHED_TEMPLATE.read_text() + OPEN_THOUGHT
    (target / "chat_template.jinja").write_text(template)
    shutil.copy(target / "chat_template.jinja", assistant / "chat_template.jinja")

    tokenizer = Tokenizer.from_dir(target)
    rows, starts = [], []
    for example in EXAMPLES.values():
        prompt = render(tokenizer, example)
        rows.append(prompt + tokenizer.encode(example.completion + stop_text(example)))
        starts.append(len(prompt))
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, (row, start) in enumerate(zip(rows, starts)):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, start - 1 : len(row) - 1] = torch.tensor(row[start:])  # next-token targets

    model = load_hf_target(target, attn="sdpa").train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    taught = labels != -100
    for _ in range(max_steps):
        logits = model(ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[taught], labels[taught])
        wanted = logits[taught].gather(1, labels[taught, None])[:, 0]
        runner_up = logits[taught].scatter(1, labels[taught, None], -1e9).max(1).values
        if (wanted - runner_up).min() > 2.0:  # greedy is certain, far beyond rounding
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        raise RuntimeError(f"the tiny model did not learn the completions (loss {loss.item()})")

    save_weights(model, target)
    train_drafter(model.eval(), assistant, ids, [len(row) for row in rows], starts)
    return target, assistant


def save_weights(model, checkpoint: Path) -> None:
    """The trained tensors, under the names (and in the file) the checkpoint was written with."""
    trained = model.state_dict()
    weights = checkpoint / "model.safetensors"
    names = load_file(weights).keys()
    save_file({name: trained[name].detach().contiguous() for name in names}, str(weights))


def train_drafter(
    target_model, assistant: Path, ids: torch.Tensor, lengths: list[int], starts: list[int]
) -> None:
    """Teach the MTP assistant the completions too, so that its drafts are accepted and the
    server commits several tokens per step. Its input at a committed position P: the token at P
    and the target's last hidden state at P - 1, attending the target's K/V rows before P (the
    sliding layers the last window + 1 of them), drafting P + 1, then again at P with its own
    draft and state (tests/test_mtp.py's hf_drafts, here for every position at once)."""
    from hf_oracle import load_hf_assistant, text_model

    drafter = load_hf_assistant(assistant).train()
    text = text_model(target_model)
    with torch.no_grad():
        out = text(input_ids=ids, return_shared_kv_states=True, use_cache=False)
        embeds = text.embed_tokens(ids)
    window = drafter.config.text_config.sliding_window + 1
    # Per row, the committed positions P the drafter learns from, padded with P = 1 (not taught).
    span = max(length - start for length, start in zip(lengths, starts))
    positions = torch.ones(len(lengths), span, dtype=torch.long)
    for row, (length, start) in enumerate(zip(lengths, starts)):
        positions[row, : length - start] = torch.arange(start - 1, length - 1)
    rows = torch.arange(len(lengths))[:, None]
    length_of = torch.tensor(lengths)[:, None]
    taught = (positions > 1) & (positions < length_of - 1)
    key = torch.arange(ids.shape[1])[None, None]
    before = key < positions[..., None]
    blocked = torch.finfo(torch.float32).min
    masks = {
        "full_attention": torch.where(before, 0.0, blocked)[:, None],
        "sliding_attention": torch.where(
            before & (key >= positions[..., None] - window), 0.0, blocked
        )[:, None],
    }
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(150):  # drafts only speed the server up: stop even if not all are right
        hidden = out.last_hidden_state[rows, positions - 1]
        loss, correct = 0.0, True
        for step in range(NUM_DRAFT_TOKENS):
            at = (positions + step).clamp(max=ids.shape[1] - 2)  # the rest is not taught
            wanted = taught & (positions + step + 1 < length_of)
            x = torch.cat([embeds[rows, at], hidden], dim=-1)
            states = drafter.model(
                inputs_embeds=drafter.pre_projection(x),
                attention_mask=masks,
                position_ids=positions,
                shared_kv_states=out.shared_kv_states,
                use_cache=False,
            ).last_hidden_state
            logits = drafter.lm_head(states)[wanted]
            labels = ids[rows, at + 1][wanted]
            loss = loss + torch.nn.functional.cross_entropy(logits, labels)
            correct = correct and bool((logits.argmax(-1) == labels).all())
            hidden = drafter.post_projection(states)
        if correct:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    save_weights(drafter, assistant)

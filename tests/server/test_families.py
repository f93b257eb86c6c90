"""Every mlx-lm family a toy config can build, served by `mlxcel serve`, agrees with its own forward.

For each family, a tiny checkpoint (tests/families.py) is served through
real HTTP. The oracle is independent of mlxcel: the same directory loaded with
``mlx_lm.utils.load``, the prompt and the tokens so far run through
``model(x)`` in one call, greedy decoding by argmax, log-softmax of the last
position (with the served tokens ahead as a guess in the same call, each taken
only where it is the argmax: :meth:`Oracle.greedy`). Families that
post-process logits in ``Model.__call__`` (soft caps, logit scales) are exactly
the ones a decode path that skips ``__call__`` gets wrong; families whose body
is not ``model.model`` fail at startup there.

:data:`FAMILIES` is the one list of families known to be served: the README
names these. Every family of mlx-lm's is in it, in
:data:`mlxcel.families.BATCH_BROKEN` (served one sequence at a time,
since mlx-lm's batch is wrong for it) or in ``tests.families.SKIPPED``, each
with a reason.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import trio

from mlxcel.families import BATCH_BROKEN
from tests.families import SKIPPED, all_families, build_family_checkpoint
from tests.server.conftest import open_stream, running_server

FAMILIES = (
    "afmoe", "apertus", "bailing_moe", "bailing_moe_v3", "cohere", "cohere2", "deepseek", "deepseek_v2",
    "deepseek_v3", "deepseek_v32", "deepseek_v41", "dots1", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4",
    "exaone_moe", "falcon_h1", "gear", "gemma", "gemma3", "gemma3_text", "gemma4", "gemma4_text", "glm", "glm4",
    "glm4_moe", "glm4_moe_lite", "gpt2", "gpt_neox", "gpt_oss", "gptj", "granite", "granitemoe", "granitemoehybrid",
    "helium", "hunyuan", "hunyuan_v1_dense", "internlm2", "internlm3", "iquestloopcoder", "kimi_k25", "kimi_vl",
    "Klear", "laguna", "lfm2", "lfm2-vl", "lfm2_moe", "lille-130m", "llama", "llama4_text", "mamba2", "mellum",
    "mimo", "minicpm", "minicpm3", "minimax", "mixtral", "muse_glimmer", "nanbeige", "nanochat", "nemotron",
    "olmo2", "olmo3", "olmoe", "phi", "phi3", "phimoe", "phixtral", "pixtral", "plamo", "plamo2",
    "plamo3", "qwen", "qwen2", "qwen2_moe", "qwen2_vl", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_moe", "qwen3_next",
    "qwen3_vl", "qwen3_vl_moe", "recurrent_gemma", "rwkv7", "seed_oss", "smollm3", "solar_open", "spark2_5",
    "stablelm", "starcoder2", "step3p5", "talkie", "telechat3", "youtu_llm",
)

# Served, and right alone, but mlx-lm's batch is wrong for them: the batch tests are expected to
# fail until it is fixed upstream or mlxcel serves them one at a time.
SERVED = (*FAMILIES, *BATCH_BROKEN)

PROMPTS = ["def wrap(text, width=70):", "class Template:", "import os\nimport sys\n"]
# The request that keeps the batch busy, its end-of-sequence tokens biased away so that it runs to
# BLOCKER_TOKENS. The batch of three 8-token requests ends with the blocker 15-17 tokens in, for every
# family (measured, 2026-12-03): 80 leaves it five times that.
BLOCKER = "# A long comment that keeps the batch busy"
BLOCKER_TOKENS = 80
MAX_TOKENS = 8
TOLERANCE = 1e-4  # float32 logits; the batch and the oracle differ only in summation order


def test_every_mlx_lm_family_is_served_or_skipped_with_a_reason() -> None:
    # A new mlx-lm family shows up here until someone builds it or says why not.
    assert not set(FAMILIES) & set(SKIPPED) and not set(BATCH_BROKEN) & {*FAMILIES, *SKIPPED}
    assert sorted({*SERVED, *SKIPPED}) == all_families()
    assert all(reason.strip() for reason in SKIPPED.values())


@dataclass
class Oracle:
    """Greedy decoding by mlx-lm's own ``model(x)``, on the full sequence at every step."""

    model: Any
    eos: set[int]
    batchable: bool
    cache: dict[tuple[int, ...], tuple[list[int], list[float]]] = field(default_factory=dict)

    def greedy(self, prompt: list[int], guess: list[int]) -> tuple[list[int], list[float]]:
        """The greedy tokens after *prompt* (MAX_TOKENS at most) and their log-probabilities.

        *guess* (the tokens a server answered) only saves forwards, never decides a token: one call of
        ``model(x)`` on the tokens so far and the guess's next ones gives, at each position, the last row of
        ``model(x)`` on the sequence up to there (the models are causal), and every token taken is that row's
        argmax. The guess is followed only while it equals those argmaxes; from its first wrong token on, the
        decoding goes one token per call, as without one (an empty guess: every token so).
        """
        key = tuple(prompt)
        if key not in self.cache:
            self.cache[key] = self._decode(prompt, MAX_TOKENS, list(guess))
        return self.cache[key]

    def _decode(self, prompt: list[int], max_tokens: int, guess: list[int]) -> tuple[list[int], list[float]]:
        import mlx.core as mx

        tokens: list[int] = []
        logprobs: list[float] = []
        while len(tokens) < max_tokens:
            ahead = guess[len(tokens):max_tokens - 1]
            logits = self.model(mx.array([prompt + tokens + ahead]))[0, len(prompt) + len(tokens) - 1:]
            rows = logits.astype(mx.float32)
            rows = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
            for i, token in enumerate(cast("list[int]", mx.argmax(rows, axis=-1).tolist())):
                if token in self.eos:
                    return tokens, logprobs
                tokens.append(token)
                logprobs.append(float(rows[i, token].item()))
                if guess[len(tokens) - 1:len(tokens)] != [token]:
                    guess = []  # wrong from here: the rows after this one are not of this sequence
                if not guess or i == len(ahead):
                    break
        return tokens, logprobs


@dataclass
class Served:
    """What one server answered; an error is kept per phase, so a batch that kills the engine
    does not hide the lone requests' answers."""

    solo: list[dict[str, Any]] = field(default_factory=list)
    batched: list[dict[str, Any]] = field(default_factory=list)
    blocker_outlived_batch: bool | None = None  # None: the family cannot batch, so there is no blocker
    solo_error: BaseException | None = None
    batch_error: BaseException | None = None


_checkpoints: dict[str, Path] = {}
_served: dict[str, Served] = {}
_oracles: dict[str, Oracle] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families")


def _checkpoint(root: Path, family: str) -> Path:
    if family not in _checkpoints:
        _checkpoints[family] = build_family_checkpoint(root / family, family)
    return _checkpoints[family]


def _oracle(directory: Path, family: str) -> Oracle:
    if family not in _oracles:
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.utils import load

        loaded: Any = load(str(directory))
        model, tokenizer = loaded
        # mlx-lm's own test of whether caches can join a batch (the server falls back to
        # one sequence at a time without it).
        # What mlxcel batches: caches that merge, and a batch mlx-lm gets right for the family.
        batchable = all(hasattr(c, "merge") for c in make_prompt_cache(model)) and family not in BATCH_BROKEN
        _oracles[family] = Oracle(model, set(tokenizer.eos_token_ids), batchable)
    return _oracles[family]


@functools.cache
def _tokenizer(directory: Path) -> Any:
    """The checkpoint's tokenizer.json, read once (each test and each request's prompt asks for it)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / "tokenizer.json"))


def _ids(directory: Path, text: str) -> list[int]:
    return list(_tokenizer(directory).encode(text).ids)


@functools.cache
def _keys(directory: Path) -> dict[str, int]:
    """Each token's key in a completion's ``top_logprobs`` (its text, or ``bytes:`` and its bytes escaped where
    they are not whole UTF-8, as OpenAI writes them), to its id."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}  # byte-level BPE's stand-in characters
    tokenizer, keys = _tokenizer(directory), {}
    for token in range(tokenizer.get_vocab_size()):
        name = tokenizer.id_to_token(token)
        raw = bytes(byte_of[c] for c in name) if all(c in byte_of for c in name) else name.encode()
        try:
            keys[raw.decode()] = token
        except UnicodeDecodeError:
            keys["bytes:" + "".join(f"\\x{b:02x}" for b in raw)] = token
    return keys


def _named(directory: Path, choice: dict[str, Any]) -> list[int]:
    """The tokens *choice*'s logprobs name (the chosen one is each position's last ``top_logprobs`` key), up to
    the first it does not: a guess for :meth:`Oracle.greedy` to check, never an expected answer."""
    keys, named = _keys(directory), []
    for top in choice["logprobs"].get("top_logprobs") or ():
        if not top or (token := keys.get(list(top)[-1])) is None:
            break
        named.append(token)
    return named


def _body(prompt: list[int], max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1}


async def _serve(directory: Path, oracle: Oracle) -> Served:
    prompts = [_ids(directory, p) for p in PROMPTS]
    served = Served()
    try:
        # No prefix cache: a batched request must not reuse the cache a lone request of the
        # same prompt left behind, or an error of the solo path would show in the batch's answers.
        argv = ["--model", str(directory), "--parallel", "4", "--prompt-cache-size", "0"]
        async with running_server(argv) as url, httpx.AsyncClient(timeout=120) as client:
            try:
                # Alone: each request is the only one, so the solo path decodes it.
                for prompt in prompts:
                    served.solo.append((await client.post(f"{url}/v1/completions", json=_body(prompt))).json())
            except Exception as exc:
                served.solo_error = exc
                return served
            await _serve_batch(client, url, directory, prompts, oracle, served)
    except BaseException as exc:  # the server itself failed (to start, or its engine stopped)
        if served.solo_error is None and len(served.solo) < len(prompts):
            served.solo_error = exc
        served.batch_error = served.batch_error or exc
    return served


async def _serve_batch(client: httpx.AsyncClient, url: str, directory: Path, prompts: list[list[int]],
                       oracle: Oracle, served: Served) -> None:
    batched: list[dict[str, Any]] = [{} for _ in prompts]

    async def one(i: int) -> None:
        batched[i] = (await client.post(f"{url}/v1/completions", json=_body(prompts[i]))).json()

    try:
        if not oracle.batchable:
            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)
        else:
            # A long request already decoding means every test request joins the batch
            # from its prefill on, never starting solo and being handed over.
            body = {**_body(_ids(directory, BLOCKER), max_tokens=BLOCKER_TOKENS), "stream": True,
                    "logprobs": None, "logit_bias": {str(token): -100 for token in oracle.eos}}
            blocker = await open_stream(url, "/v1/completions", body)
            async with blocker:
                async with trio.open_nursery() as nursery:
                    for i in range(len(prompts)):
                        nursery.start_soon(one, i)
                # Still streaming once every test request is answered: they were all batched with it.
                received = b""
                with trio.move_on_after(0.05):
                    while chunk := await blocker.receive_some():
                        received += chunk
                served.blocker_outlived_batch = b"[DONE]" not in received
    except Exception as exc:
        served.batch_error = exc
    served.batched = batched


async def _results(root: Path, family: str) -> tuple[Served, Oracle, list[list[int]]]:
    directory = _checkpoint(root, family)
    oracle = _oracle(directory, family)
    if family not in _served:
        _served[family] = await _serve(directory, oracle)
    return _served[family], oracle, [_ids(directory, p) for p in PROMPTS]


def _raise(family: str, what: str, error: BaseException | None) -> None:
    if error is not None:
        raise AssertionError(f"{family}: {what} failed: {error!r}") from error


def _check(family: str, answers: list[dict[str, Any]], oracle: Oracle, prompts: list[list[int]],
           directory: Path) -> None:
    tokenizer = _tokenizer(directory)
    for prompt, answer in zip(prompts, answers, strict=True):
        assert "choices" in answer, f"{family}: {answer}"
        choice = answer["choices"][0]
        got = choice["logprobs"]["token_logprobs"]
        tokens, expected = oracle.greedy(prompt, _named(directory, choice))
        assert choice["text"] == tokenizer.decode(tokens, skip_special_tokens=False), family
        assert len(got) == len(expected), family
        worst = max((abs(a - b) for a, b in zip(got, expected, strict=True)), default=0.0)
        assert worst <= TOLERANCE, f"{family}: logprobs differ from model(x) by up to {worst:.3g}"


def _batch_params() -> list[Any]:
    return [*FAMILIES, *BATCH_BROKEN]  # the broken-batch ones are served one at a time, and checked so


@pytest.mark.slow
@pytest.mark.parametrize("family", SERVED)
async def test_a_lone_request_has_the_logprobs_of_the_models_forward(root: Path, family: str) -> None:
    served, oracle, prompts = await _results(root, family)
    _raise(family, "serving a lone request", served.solo_error)
    _check(family, served.solo, oracle, prompts, _checkpoints[family])


@pytest.mark.slow
@pytest.mark.parametrize("family", _batch_params())
async def test_batched_requests_have_the_logprobs_of_the_models_forward(root: Path, family: str) -> None:
    served, oracle, prompts = await _results(root, family)
    _raise(family, "serving the batch", served.batch_error)
    assert served.blocker_outlived_batch in (True, None), (
        f"{family}: the blocker's {BLOCKER_TOKENS} tokens ended before the batch did, so the batch's "
        "requests may not all have joined a running batch")
    _check(family, served.batched, oracle, prompts, _checkpoints[family])


@pytest.mark.slow
@pytest.mark.parametrize("family", _batch_params())
async def test_greedy_text_alone_equals_text_in_the_batch(root: Path, family: str) -> None:
    served, _, _ = await _results(root, family)
    _raise(family, "serving a lone request", served.solo_error)
    _raise(family, "serving the batch", served.batch_error)
    assert [a["choices"][0]["text"] for a in served.solo] == [b["choices"][0]["text"] for b in served.batched]

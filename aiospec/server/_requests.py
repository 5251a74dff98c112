"""OpenAI request bodies as msgspec Structs, validated into what the engine needs.

Unknown fields are ignored (clients send many); known fields are type-checked by msgspec and
range-checked here. Parameters other servers offer and this one does not (``top_k``,
``response_format``, ``tools``, ...) are declared too, so that a request which sets one to
anything but its neutral value is refused by name instead of being served as if it had not
(``REFUSED``). Every failure is an ``ApiError`` that renders as OpenAI's error object,
``{"error": {"message", "type", "param", "code"}}``, naming the field.
"""

from __future__ import annotations

import operator
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

__all__ = (
    "REFUSED",
    "ApiError",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "Limits",
    "Parsed",
    "Prompt",
    "StreamOptions",
    "TokenizeRequest",
    "DetokenizeRequest",
    "parse_chat",
    "parse_completion",
    "parse_detokenize",
    "parse_tokenize",
)

MAX_TOP_LOGPROBS = 20  # the default of --max-logprobs (vLLM's default too)
MAX_N = 128  # OpenAI's bound on n
MAX_CHOICES = 1024  # choices of one request: len(prompt) * n
MAX_STOP_TOKEN_IDS = 1024  # the built-in engine's bound (a longer list would fail in the engine)
_ROLES = ("system", "developer", "user", "assistant", "tool")  # the roles OpenAI names
MAX_ROLE = 64  # characters of a custom role


class ApiError(Exception):
    """An error response: HTTP status plus OpenAI's error fields."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> bytes:
        return _encoder.encode(
            {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        )


class ContentPart(msgspec.Struct, gc=False):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, gc=False):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct, gc=False):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's extension: usage in every chunk


class _Common(msgspec.Struct, kw_only=True, gc=False):
    model: str | None = None
    max_tokens: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # vLLM's extensions
    ignore_eos: bool | None = False
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool | None = False
    include_stop_str_in_output: bool | None = False
    return_token_ids: bool | None = False  # prompt_token_ids and each choice's token_ids
    skip_special_tokens: bool | None = True  # no special token is ever output: nothing to skip
    spaces_between_special_tokens: bool | None = True
    # FastDeploy's extension: the draft model's logprobs, apart from the output's
    include_draft_logprobs: bool | None = False
    # SGLang's spelling of include_stop_str_in_output
    no_stop_trim: bool | None = False
    # offered elsewhere, not here: refused unless neutral (REFUSED)
    best_of: Any = None
    top_k: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    length_penalty: Any = None
    use_beam_search: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    regex: Any = None
    json_schema: Any = None
    ebnf: Any = None
    prompt_embeds: Any = None
    truncate_prompt_tokens: Any = None
    min_characters: Any = None
    priority: Any = None
    kv_transfer_params: Any = None
    lora_path: Any = None
    return_hidden_states: Any = None
    custom_logit_processor: Any = None
    vllm_xargs: Any = None


class ChatRequest(_Common, kw_only=True, gc=False):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None
    # vLLM's extensions: the chat template's flags, and the last message echoed
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    echo: bool | None = False


class CompletionRequest(_Common, kw_only=True, gc=False):
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None


# parameter -> (its neutral values, what the refusal says): set to anything else, it is refused
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "top_k": ((None, -1, 0), "top-k sampling is not supported (only -1 or 0: off)"),
    "min_p": ((None, 0), "min-p sampling is not supported (only 0: off)"),
    "repetition_penalty": ((None, 1), "repetition_penalty is not supported (only 1: off); "
                           "frequency_penalty and presence_penalty are"),
    "length_penalty": ((None, 1), "length_penalty is not supported (it applies to beam search, which is not)"),
    "use_beam_search": ((None, False), "beam search is not supported"),
    "allowed_token_ids": ((None,), "allowed_token_ids is not supported (logit_bias is)"),
    "bad_words": ((None, []), "bad_words is not supported"),
    "logits_processors": ((None, []), "logits processors are not supported"),
    "response_format": ((None, {"type": "text"}), "structured output (response_format) is not supported "
                        "(only {\"type\": \"text\"})"),
    "structured_outputs": ((None,), "structured output is not supported"),
    "guided_json": ((None,), "guided decoding is not supported"),
    "guided_regex": ((None,), "guided decoding is not supported"),
    "guided_choice": ((None,), "guided decoding is not supported"),
    "guided_grammar": ((None,), "guided decoding is not supported"),
    "guided_decoding_backend": ((None,), "guided decoding is not supported"),
    "regex": ((None,), "constrained decoding (regex) is not supported"),
    "json_schema": ((None,), "constrained decoding (json_schema) is not supported"),
    "ebnf": ((None,), "constrained decoding (ebnf) is not supported"),
    "prompt_embeds": ((None,), "prompt embeddings are not supported (text or token ids only)"),
    "truncate_prompt_tokens": ((None,), "prompt truncation is not supported"),
    "min_characters": ((None,), "min_characters is not supported (min_tokens is)"),
    "priority": ((None, 0), "request priorities are not supported (only 0)"),
    "kv_transfer_params": ((None,), "KV transfer parameters are not supported (--pd hands requests over itself)"),
    "lora_path": ((None,), "LoRA adapters are not supported"),
    "return_hidden_states": ((None, False), "hidden states are not returned"),
    "custom_logit_processor": ((None,), "custom logit processors are not supported"),
    "vllm_xargs": ((None,), "vllm_xargs is not supported"),
    "tools": ((None, []), "tools (function calling) are not supported"),
    "tool_choice": ((None, "none"), "tool_choice is not supported (only \"none\")"),
    "functions": ((None, []), "functions (function calling) are not supported"),
    "function_call": ((None, "none"), "function_call is not supported (only \"none\")"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only the text modality is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "reasoning_effort": ((None,), "reasoning_effort is not supported (the model does not reason)"),
    "chat_template": ((None,), "custom chat templates are not supported"),
    "chat_template_kwargs": ((None, {}), "chat template arguments are not supported"),
    "documents": ((None,), "documents are not supported"),
}  # fmt: skip


_encoder = msgspec.json.Encoder()


class TokenizeRequest(msgspec.Struct, gc=False):
    """``POST /tokenize`` (vLLM's route): a completion ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # the built-in vocabulary has no special tokens to add
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, gc=False):
    """``POST /detokenize`` (vLLM's route): token ids back to text."""

    tokens: list[int]
    model: str | None = None


_chat_decoder = msgspec.json.Decoder(ChatRequest)
_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_AT = re.compile(r" - at `\$\.?(.*)`$")
_MISSING = re.compile(r"^Object missing required field `(\w+)`")
# a \uXXXX escape of a UTF-16 surrogate; msgspec rejects a lone one as "truncated" input
_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(\\u[dD][c-fC-F][0-9a-fA-F]{2})?|\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def _path(msg: str) -> str | None:
    """The field path msgspec names (``$.messages[0].role``) as OpenAI's ``param``
    (``messages[0].role``); None for the whole body."""
    m = _AT.search(msg)
    return m.group(1) or None if m else None


def _lone_surrogate(body: bytes) -> int:
    """The offset of the first escape of an unpaired UTF-16 surrogate in ``body``, or -1."""
    for m in _SURROGATE.finditer(body):
        if body[m.start() + 3 : m.start() + 4] in b"cdefCDEF" or m.group(1) is None:
            return m.start()
    return -1


def _decode_error(exc: msgspec.DecodeError, body: bytes) -> ApiError:
    msg = str(exc)
    m = _MISSING.match(msg)
    if m:
        at = _path(msg)
        field = f"{at}.{m.group(1)}" if at else m.group(1)
        return ApiError(400, f"Missing required parameter: '{field}'.", param=field, code="missing_required_parameter")
    if isinstance(exc, msgspec.ValidationError):
        param = _path(msg)
        where = f"'{param}'" if param else "request body"
        return ApiError(400, f"Invalid {where}: {msg}", param=param, code="invalid_type")
    pos = _lone_surrogate(body)
    if pos >= 0:
        esc = body[pos : pos + 6].decode("ascii")
        return ApiError(
            400,
            f"We could not parse the JSON body of your request: the escape {esc} at byte {pos} is a lone "
            "UTF-16 surrogate, not a character (expected a high surrogate followed by a low one).",
            code="invalid_json",
        )
    return ApiError(400, f"We could not parse the JSON body of your request: {msg}", code="invalid_json")


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise _decode_error(exc, body) from None
    except RecursionError:
        raise ApiError(
            400,
            "We could not parse the JSON body of your request: it is nested too deeply "
            f"(expected arrays and objects nested at most {sys.getrecursionlimit()} levels).",
            code="invalid_json",
        ) from None


_CONTEXT = " (the model's context length)"  # what bounds max_tokens, named as clients look for it


def _int_range(name: str, value: int, lo: int, hi: int, why: str = "") -> None:
    if not lo <= value <= hi:
        code = "integer_below_min_value" if value < lo else "integer_above_max_value"
        raise ApiError(400, f"Invalid '{name}': {name} = {value}: expected {lo}..{hi}{why}.", param=name, code=code)


def _float_range(name: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:  # NaN fails too
        raise ApiError(400, f"Invalid '{name}': {name} = {value}: expected {lo:g}..{hi:g}.", param=name,
                       code="invalid_value")  # fmt: skip


def _unsupported(name: str, why: str) -> ApiError:
    return ApiError(400, f"Invalid '{name}': {why}.", param=name, code="unsupported_parameter")


class Limits(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """What the server allows: the context length, the default ``max_tokens``, the most
    logprobs alternatives (``--max-logprobs``) and the vocabulary size (for token ids)."""

    max_model_len: int = 8192
    default_max_tokens: int = 256
    max_logprobs: int = MAX_TOP_LOGPROBS
    vocab_size: int = 1 << 31


class Prompt(msgspec.Struct, gc=False):
    """One prompt of a request: its text (``None`` for token ids) and its token ids (``None``
    for text, tokenized by the server)."""

    text: str | None
    ids: list[int] | None


class Parsed(msgspec.Struct, kw_only=True, gc=False):
    """What one request asks of the engine and of the formatter."""

    model: str | None
    prompts: list[Prompt]
    n: int
    max_tokens: int | None  # None: --default-max-tokens, bounded by the room the prompt leaves
    top_logprobs: int  # -1: no logprobs
    prompt_logprobs: int  # -1: none
    echo: bool
    temperature: float
    seed: int | None
    stop: list[str]
    include_stop: bool
    stop_token_ids: list[int]
    min_tokens: int
    ignore_eos: bool
    logit_bias: dict[int, float] | None
    frequency_penalty: float
    presence_penalty: float
    token_ids_as_strings: bool
    draft_logprobs: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    # chat: the response message's role (vLLM's: the last message's without the generation
    # prompt) and the text that starts every choice's message (echo), "" for none
    role: str = "assistant"
    chat_echo: str = ""

    def sampling(self, choice: int) -> dict[str, Any]:
        """The engine request's sampling fields (``Admit``'s) for choice ``choice`` of a
        prompt: with a seed, choice i samples with seed + i, so that n choices differ and a
        request repeated with the same seed gives the same n texts."""
        seed = self.seed
        if seed is not None and choice:
            seed = (seed + choice + (1 << 63)) % (1 << 64) - (1 << 63)  # stays an int64
        return {
            "top_logprobs": self.top_logprobs,
            "temperature": self.temperature,
            "seed": seed,
            "ignore_eos": self.ignore_eos,
            "logit_bias": self.logit_bias,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "min_tokens": self.min_tokens,
            "stop_token_ids": self.stop_token_ids,
            "prompt_logprobs": self.engine_prompt_logprobs,
            "draft_logprobs": self.draft_logprobs,
        }

    @property
    def engine_prompt_logprobs(self) -> int:
        """The k of the prompt logprobs the engine must compute: ``prompt_logprobs``'s, and
        the completion's ``logprobs`` when ``echo`` shows the prompt's too."""
        k = self.prompt_logprobs
        if self.echo and self.top_logprobs >= 0:
            k = max(k, self.top_logprobs)
        return k


def _refusable(cls: type[_Common]) -> tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]:
    """The ``REFUSED`` fields a request class has, in ``REFUSED``'s order, and one getter of
    all of them (a tuple in one C call)."""
    names = tuple(n for n in REFUSED if n in cls.__struct_fields__)
    return names, operator.attrgetter(*names)


_REFUSABLE: dict[type[_Common], tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]] = {
    cls: _refusable(cls) for cls in (ChatRequest, CompletionRequest)
}


def _refuse_non_neutral(req: _Common) -> None:
    names, get = _REFUSABLE[type(req)]
    values = get(req)
    if values.count(None) == len(values):  # the common case: none of them set, no loop
        return
    for name, v in zip(names, values, strict=True):
        if v is not None:
            neutral, why = REFUSED[name]
            if v not in neutral:
                raise _unsupported(name, f"{name} = {msgspec.json.encode(v).decode()[:80]}: {why}")


def _common(req: _Common, max_tokens: int | None, lim: Limits) -> dict[str, Any]:
    _refuse_non_neutral(req)
    n = 1 if req.n is None else req.n
    _int_range("n", n, 1, MAX_N)
    if req.best_of is not None and (isinstance(req.best_of, bool) or req.best_of != n):
        raise _unsupported("best_of", f"best_of = {req.best_of}: only best_of = n ({n}) is supported")
    if max_tokens is not None:
        _int_range("max_tokens", max_tokens, 0, lim.max_model_len, _CONTEXT)
    temp = 1.0 if req.temperature is None else req.temperature
    if not 0.0 <= temp <= 2.0:
        raise ApiError(
            400,
            f"Invalid 'temperature': temperature = {temp}: expected 0..2.",
            param="temperature",
            code="invalid_value",
        )
    if req.top_p is not None:
        if not 0.0 < req.top_p <= 1.0:
            raise ApiError(400, f"Invalid 'top_p': top_p = {req.top_p}: expected (0, 1].", param="top_p")
        if req.top_p != 1.0:
            raise _unsupported("top_p", f"top_p = {req.top_p}: nucleus sampling is not supported (only 1: off)")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4:
        raise ApiError(400, f"Invalid 'stop': {len(stop)} sequences: expected at most 4.", param="stop")
    if any(not s for s in stop):
        raise ApiError(400, "Invalid 'stop': stop sequences must not be empty.", param="stop")
    so = req.stream_options
    if so is not None and not req.stream:
        raise ApiError(400, "Invalid 'stream_options': only allowed when 'stream' is true.", param="stream_options")
    seed = req.seed
    if seed is not None and not -(1 << 63) <= seed < 1 << 63:
        raise ApiError(400, f"Invalid 'seed': seed = {seed}: expected -2**63..2**63-1.", param="seed",
                       code="invalid_value")  # fmt: skip
    bias = None if not req.logit_bias else _logit_bias(req.logit_bias, lim.vocab_size)
    fp = 0.0 if req.frequency_penalty is None else req.frequency_penalty
    pp = 0.0 if req.presence_penalty is None else req.presence_penalty
    _float_range("frequency_penalty", fp, -2.0, 2.0)
    _float_range("presence_penalty", pp, -2.0, 2.0)
    min_tokens = req.min_tokens or 0
    _int_range("min_tokens", min_tokens, 0, max_tokens if max_tokens is not None else lim.max_model_len,
               " (at most max_tokens)" if max_tokens is not None else "")  # fmt: skip
    stop_ids = list(req.stop_token_ids or [])
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(400, f"Invalid 'stop_token_ids': {len(stop_ids)} ids: expected at most {MAX_STOP_TOKEN_IDS}.",
                       param="stop_token_ids", code="array_above_max_length")  # fmt: skip
    for i, t in enumerate(stop_ids):
        if not 0 <= t < lim.vocab_size:
            raise ApiError(400, f"Invalid 'stop_token_ids': stop_token_ids[{i}] = {t} is out of vocabulary: "
                           f"{_vocab(lim.vocab_size)}.", param="stop_token_ids", code="invalid_value")  # fmt: skip
    pl = -1 if req.prompt_logprobs is None else req.prompt_logprobs
    if req.prompt_logprobs is not None:
        _int_range("prompt_logprobs", pl, 0, lim.max_logprobs, _why(lim))
    include_usage = bool(so and so.include_usage)
    return {
        "model": req.model,
        "n": n,
        "max_tokens": max_tokens,
        "temperature": temp,
        "seed": seed,
        "stop": stop,
        "include_stop": bool(req.include_stop_str_in_output or req.no_stop_trim),
        "stop_token_ids": stop_ids,
        "min_tokens": min_tokens,
        "ignore_eos": bool(req.ignore_eos),
        "logit_bias": bias,
        "frequency_penalty": fp,
        "presence_penalty": pp,
        "prompt_logprobs": pl,
        "token_ids_as_strings": bool(req.return_tokens_as_token_ids),
        "draft_logprobs": bool(req.include_draft_logprobs),
        "stream": bool(req.stream),
        "include_usage": include_usage,
        # vLLM's rule: usage in every chunk only with include_usage
        "continuous_usage": include_usage and bool(so and so.continuous_usage_stats),
        "return_token_ids": bool(req.return_token_ids),
    }


def _message_text(i: int, m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for j, p in enumerate(m.content):
        if p.type != "text" or p.text is None:
            raise ApiError(
                400,
                f"Invalid 'messages[{i}].content[{j}]': type {p.type!r} is not supported (text only).",
                param=f"messages[{i}].content[{j}]",
            )
        parts.append(p.text)
    return "".join(parts)


_GENERATION_PROMPT = "assistant:"  # the built-in chat template's start of the assistant's turn


def chat_prompt(
    messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True, continue_final_message: bool = False
) -> str:
    """The prompt text of a conversation: the built-in model's chat template, with the start of
    the assistant's turn (``add_generation_prompt``) or the final message left open for the
    model to continue (``continue_final_message``: no line break after it)."""
    text = "".join(f"{m.role}: {_message_text(i, m)}\n" for i, m in enumerate(messages))
    if continue_final_message:
        return text[:-1]
    return text + _GENERATION_PROMPT if add_generation_prompt else text


def _logit_bias(given: dict[str, float], vocab_size: int) -> dict[int, float]:
    """``logit_bias`` with token ids for keys; a 400 that names every bad entry otherwise."""
    bias: dict[int, float] = {}
    keys: list[str] = []  # not integers
    ids: list[int] = []  # not in the vocabulary
    values: list[str] = []  # out of range
    for key, value in given.items():
        try:
            tid = int(key)
        except ValueError:
            keys.append(repr(key))
            continue
        if not 0 <= tid < vocab_size:
            ids.append(tid)
        elif not -100.0 <= value <= 100.0:
            values.append(f"{value} of token {tid}")
        else:
            bias[tid] = float(value)
    if not (keys or ids or values):
        return bias
    why = []
    if keys:
        why.append(f"key {keys[0]}: expected a token id" if len(keys) == 1 else
                   f"keys {', '.join(keys)}: expected token ids")  # fmt: skip
    if ids:
        what = f"token id {ids[0]}" if len(ids) == 1 else f"token ids {', '.join(map(str, ids))}"
        why.append(f"{what} out of vocabulary: {_vocab(vocab_size)}")
    if values:
        why.append(f"{'bias' if len(values) == 1 else 'biases'} {', '.join(values)}: expected -100..100")
    raise ApiError(400, f"Invalid 'logit_bias': {'; '.join(why)}.", param="logit_bias",
                   code=None if keys else "invalid_value")  # fmt: skip


def _check_roles(messages: Sequence[ChatMessage]) -> None:
    # a custom role (vLLM's CustomChatCompletionMessageParam) is rendered as it is: it must
    # not be empty nor able to start a line of the template's own (a line break, a control
    # character)
    for i, m in enumerate(messages):
        r = m.role
        if r in _ROLES:
            continue
        if not r or len(r) > MAX_ROLE or not r.isprintable() or ":" in r:
            raise ApiError(
                400,
                f"Invalid 'messages[{i}].role': {r!r}: expected one of {', '.join(_ROLES)}, or a custom role "
                f"of 1..{MAX_ROLE} printable characters without ':'.",
                param=f"messages[{i}].role",
            )


def parse_tokenize(body: bytes) -> tuple[TokenizeRequest, str]:
    """A ``/tokenize`` request and the text to encode: the prompt, or the conversation through
    the chat template (without the assistant's turn when ``add_generation_prompt`` is false)."""
    req: TokenizeRequest = _decode(_tokenize_decoder, body)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "Invalid request: expected exactly one of 'prompt' and 'messages'.",
                       param="prompt" if req.prompt is not None else "messages")  # fmt: skip
    if req.prompt is not None:
        return req, req.prompt
    assert req.messages is not None
    if not req.messages:
        raise ApiError(400, "Invalid 'messages': expected at least one message.", param="messages", code="empty_array")
    _check_roles(req.messages)
    return req, chat_prompt(req.messages, add_generation_prompt=req.add_generation_prompt)


def parse_detokenize(body: bytes, vocab_size: int) -> DetokenizeRequest:
    """A ``/detokenize`` request whose ids are all in the vocabulary (a 400 naming the others)."""
    req: DetokenizeRequest = _decode(_detokenize_decoder, body)
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        shown = ", ".join(map(str, bad[:8])) + (", ..." if len(bad) > 8 else "")
        raise ApiError(400, f"Invalid 'tokens': token ids {shown}: expected 0..{vocab_size - 1}.", param="tokens",
                       code="invalid_value")  # fmt: skip
    return req


def parse_chat(body: bytes, lim: Limits) -> Parsed:
    req: ChatRequest = _decode(_chat_decoder, body)
    if not req.messages:
        raise ApiError(400, "Invalid 'messages': expected at least one message.", param="messages", code="empty_array")
    _check_roles(req.messages)
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is not None:
        _int_range(name, max_tokens, 1, lim.max_model_len, _CONTEXT)
    fields = _common(req, max_tokens, lim)
    top = -1
    if req.top_logprobs is not None:
        _int_range("top_logprobs", req.top_logprobs, 0, lim.max_logprobs, _why(lim))
        if req.logprobs:
            top = req.top_logprobs
        elif req.top_logprobs:
            # 0 asks for nothing: vLLM and SGLang take it without logprobs, and return none
            raise ApiError(
                400, "Invalid 'top_logprobs': 'logprobs' must be true when 'top_logprobs' is set.", param="top_logprobs"
            )
    elif req.logprobs:
        top = 0
    gen = req.add_generation_prompt is not False  # null: the default, true
    cont = bool(req.continue_final_message)
    if cont and gen:
        # vLLM's rule and message (with add_generation_prompt left out, its template refuses)
        raise ApiError(400, "Invalid 'continue_final_message': Cannot set both `continue_final_message` and "
                       "`add_generation_prompt` to True. add_generation_prompt is true unless set to false.",
                       param="continue_final_message")  # fmt: skip
    prompt = Prompt(chat_prompt(req.messages, add_generation_prompt=gen, continue_final_message=cont), None)
    last = req.messages[-1]
    # vLLM's: without the generation prompt the reply continues the last message's role, and
    # echo starts it with that message's content when its role is the reply's
    role = "assistant" if gen else last.role
    echo = _message_text(len(req.messages) - 1, last) if req.echo and last.role == role else ""
    return Parsed(prompts=[prompt], top_logprobs=top, echo=False, role=role, chat_echo=echo, **fields)


def _vocab(vocab_size: int) -> str:
    return f"expected 0..{vocab_size - 1} (vocabulary size {vocab_size})"


def _why(lim: Limits) -> str:
    return " (--max-logprobs)" if lim.max_logprobs != MAX_TOP_LOGPROBS else ""


def _token_ids(ids: list[int], where: str, lim: Limits) -> list[int]:
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            why = f"expected a token id, {_vocab(lim.vocab_size)}"
        elif not 0 <= t < lim.vocab_size:
            why = f"is out of vocabulary: {_vocab(lim.vocab_size)}"
        else:
            continue
        raise ApiError(400, f"Invalid '{where}': {where}[{i}] = {t!r} {why}.", param=where, code="invalid_value")
    if not ids:
        raise ApiError(400, f"Invalid '{where}': expected at least one token id.", param=where, code="empty_array")
    return ids


def _prompts(p: str | list[str | int | list[int]], lim: Limits) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(p, str):
        return [Prompt(p, None)]
    if not p:
        raise ApiError(400, "Invalid 'prompt': expected at least one prompt.", param="prompt", code="empty_array")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        return [Prompt(None, _token_ids(p, "prompt", lim))]  # type: ignore[arg-type]
    out = []
    kind = type(p[0])  # strings or lists of ids, as OpenAI's and vLLM's API: one kind a request
    for i, x in enumerate(p):
        if isinstance(x, str) and kind is str:
            out.append(Prompt(x, None))
        elif isinstance(x, list) and kind is list:
            out.append(Prompt(None, _token_ids(x, f"prompt[{i}]", lim)))
        else:
            raise ApiError(400, f"Invalid 'prompt': prompt[{i}] = {x!r}: expected a string, a list of strings, a "
                           "list of token ids or a list of lists of token ids, not a mixture.",
                           param="prompt")  # fmt: skip
    return out


def parse_completion(body: bytes, lim: Limits) -> Parsed:
    req: CompletionRequest = _decode(_completion_decoder, body)
    if req.suffix:
        raise ApiError(400, "Invalid 'suffix': suffix is not supported.", param="suffix", code="unsupported_value")
    prompts = _prompts(req.prompt, lim)
    echo = bool(req.echo)
    if req.max_tokens is not None:
        # max_tokens = 0 with echo scores a prompt (its logprobs) without generating
        _int_range("max_tokens", req.max_tokens, 0 if echo else 1, lim.max_model_len, _CONTEXT)
    fields = _common(req, req.max_tokens, lim)
    top = -1
    if req.logprobs is not None:
        _int_range("logprobs", req.logprobs, 0, lim.max_logprobs, _why(lim))
        top = req.logprobs
    if len(prompts) * fields["n"] > MAX_CHOICES:
        raise ApiError(400, f"Invalid 'n': {len(prompts)} prompts x n = {fields['n']}: expected at most "
                       f"{MAX_CHOICES} choices.", param="n", code="integer_above_max_value")  # fmt: skip
    return Parsed(prompts=prompts, top_logprobs=top, echo=echo, **fields)

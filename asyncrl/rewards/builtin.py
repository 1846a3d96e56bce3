"""Built-in reward factories (entry points `asyncrl.rewards`: exact_match, math_verify, regex,
length_penalty).

Each factory takes a reward's `options`, checks them once (a bad option is a ValueError at config
load, see base.check_rewards) and returns `fn(sample: RewardInput) -> float`. All but math_verify
are cheap and pure: they say so with `fn.asyncrl_cheap = True`, and the Scorer then runs them in a
thread rather than the worker pool. math_verify (sympy) can hang on adversarial input, so it runs
in the pool, whose per-call timeout kills it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from fractions import Fraction

from asyncrl.rewards.base import RewardInput

Reward = Callable[[RewardInput], float]

NORMALIZERS = ("strip", "lower", "whitespace", "punctuation", "number")
_TRAILING_PUNCTUATION = ".,!?"
_QUOTE_PAIRS = {'"': '"', "'": "'", "`": "`", "\u201c": "\u201d", "\u2018": "\u2019"}
# A decimal number with optional sign and thousands separators ("-1,234.5", ".5"); fractions and
# exponents are left to math_verify.
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_REGEX_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE, "a": re.ASCII}


def _cheap(fn: Reward) -> Reward:
    fn.asyncrl_cheap = True  # type: ignore[attr-defined]
    return fn


# ---------------------------------------------------------------- extraction


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces kept; None if none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    if text[start:brace].strip() not in ("\\boxed", "\\fbox"):
        return None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : i]
    return None  # unbalanced: the completion was cut inside the box


def last_number(text: str) -> str | None:
    """The last decimal number in `text`, thousands separators removed; None if none."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def _after(marker: str) -> Callable[[str], str | None]:
    def extract(text: str) -> str | None:
        at = text.rfind(marker)
        return None if at < 0 else text[at + len(marker) :]

    return extract


def _extractor(extract: str) -> Callable[[str], str | None]:
    if extract == "all":
        return lambda text: text
    if extract == "last_number":
        return last_number
    if extract == "boxed":
        return last_boxed
    if extract.startswith("after:") and len(extract) > len("after:"):
        return _after(extract[len("after:") :])
    raise ValueError(
        f"extract = {extract!r} is not one of 'all', 'last_number', 'boxed', 'after:<marker>' (e.g. 'after:####')"
    )


# ---------------------------------------------------------------- normalisation


def _as_number(text: str) -> Fraction | None:
    try:
        return Fraction(text.replace(",", "").strip())
    except (ValueError, ZeroDivisionError):
        return None


def _strip_punctuation(text: str) -> str:
    text = text.strip().rstrip(_TRAILING_PUNCTUATION).strip()
    while len(text) >= 2 and _QUOTE_PAIRS.get(text[0]) == text[-1]:
        text = text[1:-1].strip().rstrip(_TRAILING_PUNCTUATION).strip()
    return text


def _normalizer(names: Iterable[str]) -> Callable[[str], str]:
    chosen = set(names)
    unknown = chosen - set(NORMALIZERS)
    if unknown:
        raise ValueError(f"normalize: unknown {sorted(unknown)}; valid: {', '.join(NORMALIZERS)}")

    def normalize(text: str) -> str:  # a fixed order, whatever order the options list
        if "strip" in chosen:
            text = text.strip()
        if "whitespace" in chosen:
            text = " ".join(text.split())
        if "lower" in chosen:
            text = text.lower()
        if "punctuation" in chosen:
            text = _strip_punctuation(text)
        return text

    return normalize


# ---------------------------------------------------------------- factories


def exact_match(normalize: Iterable[str] | str = ("strip",), extract: str = "all") -> Reward:
    """1.0 when the extracted completion equals the answer after `normalize`, else 0.0.

    normalize: any of strip, lower, whitespace (collapse runs), punctuation (trailing .,!? and
    surrounding quotes), number (equal as numbers when both parse: "14.0" == "14", "1,000" ==
    "1000"). extract: all, last_number, boxed (last \\boxed{...}), after:<marker>.
    """
    names = (normalize,) if isinstance(normalize, str) else tuple(normalize)
    norm = _normalizer(names)
    as_numbers = "number" in names
    pick = _extractor(extract)

    def exact_match_reward(sample: RewardInput) -> float:
        found = pick(sample.completion)
        if found is None:
            return 0.0
        got, want = norm(found), norm(sample.answer)
        if as_numbers:
            got_n, want_n = _as_number(got), _as_number(want)
            if got_n is not None and want_n is not None:
                return 1.0 if got_n == want_n else 0.0
        return 1.0 if got == want else 0.0

    return _cheap(exact_match_reward)


def regex(
    pattern: str, mode: str = "search", reward: float = 1.0, otherwise: float = 0.0, flags: str = ""
) -> Reward:
    """A format reward: `reward` when `pattern` matches the completion (mode search or fullmatch),
    else `otherwise`. flags: letters of i (ignore case), m (multiline), s (dot matches newline),
    x (verbose), a (ASCII)."""
    if mode not in ("search", "fullmatch"):
        raise ValueError(f"mode = {mode!r}; valid: 'search', 'fullmatch'")
    bits = 0
    for letter in flags:
        if letter not in _REGEX_FLAGS:
            raise ValueError(
                f"flags = {flags!r}: unknown flag {letter!r}; valid letters: {''.join(_REGEX_FLAGS)}"
            )
        bits |= _REGEX_FLAGS[letter]
    try:
        compiled = re.compile(pattern, bits)
    except re.error as exc:
        raise ValueError(f"pattern = {pattern!r} is not a valid regular expression: {exc}") from None
    match = compiled.search if mode == "search" else compiled.fullmatch
    hit, miss = float(reward), float(otherwise)

    def regex_reward(sample: RewardInput) -> float:
        return hit if match(sample.completion) is not None else miss

    return _cheap(regex_reward)


def length_penalty(
    max_tokens: int | None = None, buffer_tokens: int | None = None, penalty: float = 1.0
) -> Reward:
    """DAPO's soft overlong punishment (add it to a correctness reward).

    With L = completion tokens, Lmax = max_tokens (default: the sample's max_new_tokens) and
    Lc = buffer_tokens (default: Lmax // 5, DAPO's 4096 of 20480; at most Lmax):
    0 when L <= Lmax - Lc; (Lmax - Lc - L) / Lc * penalty up to Lmax; -penalty beyond.
    """
    if max_tokens is not None and max_tokens <= 0:
        raise ValueError(f"max_tokens = {max_tokens} must be > 0 (or unset: the sample's max_new_tokens)")
    if buffer_tokens is not None and buffer_tokens <= 0:
        raise ValueError(f"buffer_tokens = {buffer_tokens} must be > 0 (or unset: a fifth of max_tokens)")
    if max_tokens is not None and buffer_tokens is not None and buffer_tokens > max_tokens:
        raise ValueError(f"buffer_tokens = {buffer_tokens} exceeds max_tokens = {max_tokens}")
    if penalty < 0:
        raise ValueError(f"penalty = {penalty} must be >= 0 (it is subtracted)")

    def length_penalty_reward(sample: RewardInput) -> float:
        limit = max_tokens if max_tokens is not None else sample.max_new_tokens
        buffer = min(buffer_tokens if buffer_tokens is not None else max(1, limit // 5), limit)
        length = sample.num_tokens
        if length <= limit - buffer:
            return 0.0
        if length <= limit:
            return (limit - buffer - length) / buffer * penalty
        return -float(penalty)

    return _cheap(length_penalty_reward)


class _DropTimeoutNotice(logging.Filter):
    """math_verify warns that its signal timeout is off; the worker pool enforces timeouts."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


def math_verify(
    extract: str = "boxed", float_rounding: int = 6, numeric_precision: int = 15, strict: bool = True
) -> Reward:
    """1.0 when the completion's answer is mathematically equal to the ground truth (Hugging
    Face's math_verify: LaTeX and plain answers, "\\boxed{1/2}" == "0.5"), else 0.0.

    extract: boxed (only the last \\boxed{...} counts; none = 0.0) or all (math_verify finds
    the answer in the whole completion). Not cheap: runs in the worker pool.
    """
    if extract not in ("boxed", "all"):
        raise ValueError(f"extract = {extract!r}; valid: 'boxed', 'all'")
    try:
        import math_verify as mv
    except ImportError as exc:  # a declared dependency; only a broken install gets here
        raise ValueError(f"the math_verify reward needs the math-verify package: {exc}") from None
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTimeoutNotice) for f in logger.filters):
            logger.addFilter(_DropTimeoutNotice())

    # math_verify's own timeouts use signal.alarm, which works only in a main thread and would
    # fight our pool's timeout; both are turned off (None) and the pool kills a hung call.
    def parse(text: str) -> list:
        return mv.parse(text, parsing_timeout=None)

    def math_verify_reward(sample: RewardInput) -> float:
        answer = sample.answer.strip()
        gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
        if extract == "boxed":
            boxed = last_boxed(sample.completion)
            if boxed is None:
                return 0.0
            pred = parse(f"${boxed}$")
        else:
            pred = parse(sample.completion)
        if not gold or not pred:
            return 0.0
        ok = mv.verify(
            gold,
            pred,
            float_rounding=float_rounding,
            numeric_precision=numeric_precision,
            strict=strict,
            timeout_seconds=None,
        )
        return 1.0 if ok else 0.0

    return math_verify_reward

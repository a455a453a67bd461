"""No secret in what a command shows or logs: `redact(text)` hides credentials before a line leaves
the process (the error line `ssl_vit.cli.main` prints, every log record once `redact_logs` is on, every
config `ssl_vit.tracking.WandbLogger` sends to W&B). A run's own config.yaml keeps its URLs whole: a
resume reads its shards from them.

What is hidden, each replaced by `***`:
- the values of the credential variables (`SECRET_ENV`: HF_TOKEN, W&B's and the clouds' keys), in every
  shape a message may quote them: as set (a trailing newline or spaces included), cleaned as
  huggingface_hub cleans a token, as Python's repr writes them (`\\n` escaped, bytes), and each line
  of a multi-line value;
- header values that carry credentials (`Authorization`, `Proxy-Authorization`, `Cookie`, `X-Api-Key`,
  `Bearer ...`, `Basic ...`), the password of a URL (`https://user:PASSWORD@host`), the signature and
  token parameters of presigned URLs, and Hugging Face tokens (`hf_...`) wherever they come from.

Stdlib only, and cheap: a few substitutions per line.
"""

from __future__ import annotations

import logging
import os
import re

HIDDEN = "***"
SECRET_ENV = (
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
    "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN", "GOOGLE_API_KEY", "GITHUB_TOKEN",
)  # fmt: skip
_PATTERNS = (
    (
        re.compile(
            r"(?i)\b((?:proxy-)?authorization|cookie|x-api-key|api-key)(['\"]?\s*[:=]\s*['\"]?)"
            r"(?:(?:bearer|basic|token)\s+)?[^\s'\",;)}]+"
        ),
        rf"\1\2{HIDDEN}",
    ),  # fmt: skip
    (re.compile(r"\b(Bearer|Basic)\s+[A-Za-z0-9._~+/=-]{8,}"), rf"\1 {HIDDEN}"),
    (re.compile(r"(://[^/@\s:]*):[^/@\s]*@"), rf"\1:{HIDDEN}@"),
    (
        re.compile(
            r"(?i)([?&](?:x-amz-signature|x-amz-credential|x-amz-security-token|signature|sig|token|"
            r"access_token|api_key|key)=)[^&\s'\"]+"
        ),
        rf"\1{HIDDEN}",
    ),  # fmt: skip
    (re.compile(r"\bhf_[A-Za-z0-9]{8,}"), f"hf_{HIDDEN}"),
)


def clean_token(value: str) -> str:
    """A token as huggingface_hub reads one from the environment: line breaks removed, spaces stripped
    (`echo $(cat token) > .env` leaves a newline)."""
    return value.replace("\r", "").replace("\n", "").strip()


def secret_values(environ=os.environ) -> list[str]:
    """Every shape in which a message may quote the credential variables' values, longest first."""
    found: set[str] = set()
    for name in SECRET_ENV:
        value = environ.get(name)
        if not value:
            continue
        shapes = {value, value.strip(), clean_token(value), repr(value)[1:-1]}
        shapes.add(repr(value.encode("utf-8", "replace"))[2:-1])
        shapes.update(part for part in re.split(r"[\r\n]+", value) if part.strip())
        found.update(shape for shape in shapes if len(shape.strip()) >= 4)
    return sorted(found, key=len, reverse=True)


def redact(text: str, environ=os.environ) -> str:
    """`text` with every credential it quotes replaced by `***`."""
    for value in secret_values(environ):
        text = text.replace(value, HIDDEN)
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def redacted(value):
    """A config (nested dicts, lists, strings) with every string redacted, for what leaves the machine
    (the W&B run's config)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: redacted(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redacted(item) for item in value)
    return value


def redact_logs() -> None:
    """Every log record of this process redacted as it is made, whichever library logs it."""
    make = logging.getLogRecordFactory()
    if getattr(make, "redacts", False):
        return

    def record(*args, **kwargs) -> logging.LogRecord:
        made = make(*args, **kwargs)
        try:
            message = made.getMessage()
        except Exception:  # a record whose arguments do not fit its format: logging says so itself
            return made
        hidden = redact(message)
        if hidden != message:
            made.msg, made.args = hidden, ()
        return made

    record.redacts = True
    logging.setLogRecordFactory(record)

"""`ssl_vit.redact`: every shape of a credential a message may quote is hidden, and nothing else."""

import logging

import pytest

from ssl_vit.redact import redact, redact_logs, redacted

ENV = {"HF_TOKEN": "hf_Zq7SecretTok123\n", "WANDB_API_KEY": "  0123456789abcdef0123  "}


@pytest.mark.parametrize(
    "text, shown",
    [
        ("Invalid header value b'Bearer hf_Zq7SecretTok123\\n'", "Invalid header value b'Bearer ***'"),
        ("token 'hf_Zq7SecretTok123\\n' refused", "token '***' refused"),
        ("key 0123456789abcdef0123 refused", "key *** refused"),
        ("Authorization: Bearer abcdefghij12", "Authorization: ***"),
        ("{'Authorization': 'token abcdefghij12'}", "{'Authorization': '***'}"),
        ("https://me:pa55word@host/x.tar", "https://me:***@host/x.tar"),
        ("https://b.s3.amazonaws.com/x.tar?X-Amz-Signature=abc123&y=1", "https://b.s3.amazonaws.com/x.tar?X-Amz-Signature=***&y=1"),
        ("an hf_AbCdEfGh12345678 from elsewhere", "an hf_*** from elsewhere"),
        # what is no credential stays as it is
        ("a basic checkpoint at http://127.0.0.1:8765/val-000000.tar", "a basic checkpoint at http://127.0.0.1:8765/val-000000.tar"),
        ("hf_source at step 12", "hf_source at step 12"),
    ],
)  # fmt: skip
def test_every_shape_of_a_credential_is_hidden_and_nothing_else(text, shown):
    assert redact(text, ENV) == shown


def test_a_config_for_wandb_and_every_log_record_are_redacted(monkeypatch, caplog):
    monkeypatch.setenv("HF_TOKEN", "hf_Zq7SecretTok123\n")
    config = {"data": {"train_urls": ["https://me:pa55@host/a.tar"], "n": 3}, "name": "hf_Zq7SecretTok123"}
    assert redacted(config) == {"data": {"train_urls": ["https://me:***@host/a.tar"], "n": 3}, "name": "***"}
    factory = logging.getLogRecordFactory()
    try:
        redact_logs()
        with caplog.at_level(logging.WARNING, "ssl_vit.test"):
            logging.getLogger("ssl_vit.test").warning("reading failed (%s)", "Bearer hf_Zq7SecretTok123")
        assert caplog.messages == ["reading failed (Bearer ***)"]
    finally:
        logging.setLogRecordFactory(factory)


def test_the_wandb_logger_hides_credentials_in_the_config_it_sends(monkeypatch, tmp_path):
    from pytorch_lightning.loggers import WandbLogger as LightningWandbLogger

    from ssl_vit.tracking import WandbLogger

    sent = []
    monkeypatch.setattr(
        LightningWandbLogger, "log_hyperparams", lambda self, params, *a, **k: sent.append(params)
    )
    logger = WandbLogger(save_dir=str(tmp_path), project="p", offline=True)
    logger.log_hyperparams({"cli": {"data": {"train_urls": "https://me:pa55@host/a.tar"}, "seed": 0}})
    assert sent == [{"cli": {"data": {"train_urls": "https://me:***@host/a.tar"}, "seed": 0}}]

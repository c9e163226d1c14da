"""Credentials never leave the process (defrag.urls.redact), and the recommended ways to give
them (~/.netrc, an Authorization header from DEFRAG_HTTP_AUTHORIZATION) against a real server
on 127.0.0.1 that demands basic authentication (tests/servers.py).

The end-to-end test trains with `data.shards=http://user:SECRET@127.0.0.1:PORT` and evaluates
the best model with the same URL: SECRET is in no file of the run folder (mlflow.db included)
and in no output of either command.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest
import torch
from mlflow import MlflowClient

from defrag.cli import one_line_errors
from defrag.urls import AUTHORIZATION_ENV, MASK, ShardError, open_url, read_url, redact
from defrag.vocab import Vocabulary
from featurizer.command import main as featurize_command
from featurizer.pipeline import Settings, featurize
from featurizer.sources import read_jsonl
from featurizer.synthetic import generate, write_img2dataset
from tests import DEFRAG
from tests.servers import basic_authorization, serve_folder
from tests.test_tracking import copy_store
from tests.test_train_e2e import ROOT, tiny_config
from trainer.config import Config, ModelConfig
from trainer.data.shardset import locate_split
from trainer.model import DeFragModel
from trainer.store.model_folder import save_model_folder
from trainer.store.tracking import ERROR_TAG, Tracker, flatten
from trainer.training.checkpoint import TrainState, resume_changes, save_checkpoint
from trainer.training.engine import build_engine

USER, PASSWORD = "reader", "pw-7f3a9c"
STALLED = "train/shard-000001.tar"  # the server sends half of it and holds the connection

# (text, what redact must make of it)
SPELLINGS = [
    ("http://user:s3cretPW@127.0.0.1:8799", f"http://user:{MASK}@127.0.0.1:8799"),
    ("https://user:p%40ss@host/f8k/train/shard-{000000..000003}.tar",
     f"https://user:{MASK}@host/f8k/train/shard-{{000000..000003}}.tar"),
    ("https://u:p@ss@host/x", f"https://u:{MASK}@host/x"),  # an @ left unencoded
    ("HTTPS://U:PW@HOST/X", f"HTTPS://U:{MASK}@HOST/X"),
    ("http://ghp_token123@github.com/x", f"http://{MASK}@github.com/x"),  # a token as the user
    ("ftp://anon:mail@ftp.example.org/pub", f"ftp://anon:{MASK}@ftp.example.org/pub"),
    ("http://u:a@h1/x.tar::http://v:b@h2/y.tar", f"http://u:{MASK}@h1/x.tar::http://v:{MASK}@h2/y.tar"),
    ("{http://u:a@h1/x.tar,http://v:b@h2/y.tar}", f"{{http://u:{MASK}@h1/x.tar,http://v:{MASK}@h2/y.tar}}"),
    ("https://b.s3.amazonaws.com/train/shard-000000.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256"
     "&X-Amz-Credential=AKIA%2F20240101%2Fus-east-1&X-Amz-Date=20240101T000000Z&X-Amz-Expires=3600"
     "&X-Amz-SignedHeaders=host&X-Amz-Security-Token=FQoGZXIvYXdz&X-Amz-Signature=0a1b2c",
     "https://b.s3.amazonaws.com/train/shard-000000.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256"
     f"&X-Amz-Credential={MASK}&X-Amz-Date=20240101T000000Z&X-Amz-Expires=3600"
     f"&X-Amz-SignedHeaders=host&X-Amz-Security-Token={MASK}&X-Amz-Signature={MASK}"),
    ("https://storage.googleapis.com/b/o?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=sa%40p"
     "&X-Goog-Signature=9f8e", "https://storage.googleapis.com/b/o?X-Goog-Algorithm=GOOG4-RSA-SHA256"
     f"&X-Goog-Credential={MASK}&X-Goog-Signature={MASK}"),
    ("https://storage.googleapis.com/b/o?GoogleAccessId=sa@p.iam&Expires=17&Signature=ab%3D",
     f"https://storage.googleapis.com/b/o?GoogleAccessId=sa@p.iam&Expires=17&Signature={MASK}"),
    ("https://acc.blob.core.windows.net/c/t.tar?sv=2022-11-02&se=2024&sp=r&sig=AbC%2Bd%3D",
     f"https://acc.blob.core.windows.net/c/t.tar?sv=2022-11-02&se=2024&sp=r&sig={MASK}"),
    ("https://d1.cloudfront.net/t.tar?Expires=1&Signature=a~b_&Key-Pair-Id=K2",
     f"https://d1.cloudfront.net/t.tar?Expires=1&Signature={MASK}&Key-Pair-Id=K2"),
    ("https://h/x?token=abc&key=K1&api_key=K2&APIKEY=K3&access_token=T#frag",
     f"https://h/x?token={MASK}&key={MASK}&api_key={MASK}&APIKEY={MASK}&access_token={MASK}#frag"),
    ("pipe:AWS_SECRET_ACCESS_KEY=abc AWS_SESSION_TOKEN=def aws s3 cp s3://b/k -",
     f"pipe:AWS_SECRET_ACCESS_KEY={MASK} AWS_SESSION_TOKEN={MASK} aws s3 cp s3://b/k -"),
    ("pipe:curl -s -u user:pw http://h/x", f"pipe:curl -s -u user:{MASK} http://h/x"),
    ("pipe:curl -s --user 'user:pw' http://h/x", f"pipe:curl -s --user 'user:{MASK}' http://h/x"),
    ("pipe:curl -H 'Authorization: Bearer TOK' http://h/x",
     f"pipe:curl -H 'Authorization: Bearer {MASK}' http://h/x"),
    ("pipe:wget --password=PW -O - http://h/x", f"pipe:wget --password={MASK} -O - http://h/x"),
    ("pipe:tool --token TOK http://h/x", f"pipe:tool --token {MASK} http://h/x"),
    ("cannot read http://user:SECRET@127.0.0.1:5/manifest.json after 4 attempts (curl exit 22)",
     f"cannot read http://user:{MASK}@127.0.0.1:5/manifest.json after 4 attempts (curl exit 22)"),
    ("shard https://h/x.tar?sig=abc: unreadable (at https://h/y?token=t) [key=k]",
     f"shard https://h/x.tar?sig={MASK}: unreadable (at https://h/y?token={MASK}) [key={MASK}]"),
    # left alone: names that only end like a secret's, user@host outside a URL, other settings
    ("keyword=1 monkey=2 data.shards=http://h/x sig=3",
     f"keyword=1 monkey=2 data.shards=http://h/x sig={MASK}"),
    ("mailto:a@b.c user@host s3://bucket/f8k/train/shard-000000.tar",
     "mailto:a@b.c user@host s3://bucket/f8k/train/shard-000000.tar"),
]

SECRET = "Zq9s3cr3t"
# A credential in each spelling a URL carries one, by the config key it stands in: a password,
# and the tokens of signed URLs (S3 presigned, GCS signed, an Azure SAS, a generic token)
LEAKY = {
    "data.shards": f"https://{USER}:{SECRET}@h.example.org/f8k/shard-{{000000..000003}}.tar",
    "data.val_shards": ("https://b.s3.amazonaws.com/f8k/val.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256"
                        f"&X-Amz-Credential=AKIA{SECRET}%2F20240101&X-Amz-Date=20240101T000000Z"
                        f"&X-Amz-Security-Token={SECRET}&X-Amz-Signature={SECRET}"),
    "data.manifest": ("https://storage.googleapis.com/b/manifest.json?X-Goog-Algorithm=GOOG4-RSA-"
                      f"SHA256&X-Goog-Credential=sa{SECRET}&X-Goog-Signature={SECRET}"),
    "data.vocab": f"https://acc.blob.core.windows.net/c/vocab.json?sv=2022-11-02&sp=r&sig={SECRET}",
    "model.word_vectors": f"https://h.example.org/glove.txt?token={SECRET}&lang=en",
}


def leaky_config() -> Config:
    """A config holding every LEAKY URL at its key."""
    sections: dict = {}
    for key, url in LEAKY.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = url
    return Config.from_dict(sections)


def masked_leaky(config: dict) -> dict:
    """The LEAKY keys of a written config (nested dicts), to compare with MASKED."""
    flat = flatten(config)
    return {key: flat[key] for key in LEAKY}


MASKED = {  # LEAKY as every place must write it
    "data.shards": f"https://{USER}:{MASK}@h.example.org/f8k/shard-{{000000..000003}}.tar",
    "data.val_shards": ("https://b.s3.amazonaws.com/f8k/val.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256"
                        f"&X-Amz-Credential={MASK}&X-Amz-Date=20240101T000000Z"
                        f"&X-Amz-Security-Token={MASK}&X-Amz-Signature={MASK}"),
    "data.manifest": ("https://storage.googleapis.com/b/manifest.json?X-Goog-Algorithm=GOOG4-RSA-"
                      f"SHA256&X-Goog-Credential={MASK}&X-Goog-Signature={MASK}"),
    "data.vocab": f"https://acc.blob.core.windows.net/c/vocab.json?sv=2022-11-02&sp=r&sig={MASK}",
    "model.word_vectors": f"https://h.example.org/glove.txt?token={MASK}&lang=en",
}


def signed(secret: str) -> str:
    """The query of a signed URL (S3 presigned, GCS signed, Azure SAS, a token), each credential
    `secret` (the server of the tests reads none of them)."""
    return "&".join(f"{name}={secret}" for name in (
        "X-Amz-Credential", "X-Amz-Security-Token", "X-Amz-Signature", "X-Goog-Signature", "sig",
        "token"))


def files_holding(folder: Path, secret: str = SECRET) -> list[Path]:
    """The files under `folder` whose bytes hold `secret`."""
    return [path for path in folder.rglob("*") if path.is_file()
            and secret.encode() in path.read_bytes()]


SECRET_PARAMS = ["X-Amz-Signature", "x-amz-credential", "X-Amz-Security-Token", "X-Goog-Signature",
                 "Signature", "sig", "token", "access_token", "refresh_token", "key", "api_key",
                 "apikey", "client_secret", "password"]


@pytest.mark.parametrize(("text", "masked"), SPELLINGS)
def test_redact_masks_each_spelling_and_keeps_the_rest(text: str, masked: str) -> None:
    assert redact(text) == masked
    assert redact(masked) == masked  # masked values compare equal to themselves


def test_every_secret_parameter_is_masked_wherever_the_url_stands() -> None:
    """Each secret query parameter, first, between others or last, of a URL standing alone, in
    a `::` list, a brace list, a `pipe:` command and an error line: its value is gone, every
    other character stays."""
    secret = "Zq9Secret%2Bvalue"
    for name, place in itertools.product(SECRET_PARAMS, range(3)):
        params = [("X-Amz-Date", "20240101"), ("sp", "r")]
        params.insert(place, (name, secret))
        url = "https://h.example.org/f8k/train/shard-000001.tar?" + "&".join(
            f"{k}={v}" for k, v in params)
        want = url.replace(secret, MASK)
        for form in ("{}", "{}::http://h/x.tar", "{{{},http://h/x.tar}}", "pipe:curl -s '{}'",
                     "cannot read shard {} after 4 attempts (curl exit 22, HTTP 404)"):
            assert redact(form.format(url)) == form.format(want), (name, place, form)


def test_redact_masks_the_strings_of_a_config() -> None:
    cfg = leaky_config()
    masked = redact(cfg.to_dict())
    assert SECRET not in json.dumps(masked)
    assert masked_leaky(masked) == MASKED
    assert masked["optim"] == cfg.to_dict()["optim"]
    assert redact(masked) == masked


def test_one_line_errors_and_the_log_lines_of_a_command_mask_credentials(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with pytest.raises(SystemExit) as stop, one_line_errors("prog"):
        for url in LEAKY.values():
            logging.getLogger("trainer.data.reader").warning("shard %s: retried", url)
        raise ValueError(f"shard {LEAKY['data.shards']} is not in {LEAKY['data.manifest']}")
    assert stop.value.code == (f"prog: error: shard {MASKED['data.shards']} is not in "
                               f"{MASKED['data.manifest']} (--debug shows the traceback)")
    retried = [record.getMessage() for record in caplog.records
               if record.name == "trainer.data.reader"]
    assert retried == [f"shard {url}: retried" for url in MASKED.values()]
    assert SECRET not in caplog.text


def test_the_params_config_artifact_and_tags_of_a_run_are_masked(
        tmp_path: Path, empty_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a real embedded store: no byte of mlflow.db or of the artifacts holds a credential."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    copy_store(empty_store, tmp_path)  # the run folder's store, its schema made once
    tracker = Tracker.start(leaky_config(), tmp_path, rank=0)
    with pytest.raises(ValueError), tracker:
        tracker.set_tag("note", f"read from {LEAKY['data.shards']}")
        raise ValueError(f"shard {LEAKY['data.val_shards']} is not in the manifest")
    run = MlflowClient(tracker.tracking_uri).get_run(tracker.run_id)
    assert run.info.status == "FAILED"
    assert masked_leaky(run.data.params) == MASKED
    assert run.data.tags["note"] == f"read from {MASKED['data.shards']}"
    assert run.data.tags[ERROR_TAG] == (f"ValueError: shard {MASKED['data.val_shards']} is not "
                                        "in the manifest")
    artifact, = (tmp_path / "mlartifacts").rglob("config.json")
    assert masked_leaky(json.loads(artifact.read_text())) == MASKED
    assert files_holding(tmp_path) == []


def test_the_config_json_of_a_checkpoint_and_a_model_folder_is_masked(tmp_path: Path) -> None:
    """Both written by Config.to_json; a resume with the same (unmasked) config changes nothing."""
    cfg, vocab = leaky_config(), Vocabulary(["a", "dog"], ["det"])
    model = DeFragModel.from_config(ModelConfig(embed_dim=8, word_dim=4, pretrained=False), vocab)
    engine = build_engine(model, cfg, False, torch.device("cpu"), world_size=1)
    checkpoint = save_checkpoint(engine, TrainState(), tmp_path / "run", rank=0, keep=1,
                                 config=cfg)
    folder = save_model_folder(tmp_path / "model", model, cfg, vocab)
    for written in (checkpoint, folder):
        assert masked_leaky(json.loads((written / "config.json").read_text())) == MASKED
    assert files_holding(tmp_path) == []
    assert resume_changes(checkpoint, TrainState(), cfg, world_size=1) == []


# ---------------------------------------------------------------------------------------------
# Reading from a server that demands basic authentication


@pytest.fixture
def locked(shards: Path):
    """The synthetic shards over HTTP, behind basic authentication as USER:PASSWORD."""
    with serve_folder(shards, basic_auth=f"{USER}:{PASSWORD}", stall={STALLED}) as server:
        yield server


def curl_command_line(url: str, server) -> bytes:
    """The command line of the curl process reading `url`, a STALLED file: curl is still
    running once the server has logged the request, which it does past its authentication."""
    stream = open_url(url, timeout=30)
    try:
        for _ in range(400):
            if server.count(STALLED):
                return Path(f"/proc/{stream.proc.pid}/cmdline").read_bytes()
            time.sleep(0.05)
        raise AssertionError(f"the server never answered {redact(url)}")
    finally:
        stream.proc.kill()
        with contextlib.suppress(OSError):
            stream.close()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty home folder (no ~/.netrc) and no Authorization header in the environment."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(AUTHORIZATION_ENV, raising=False)
    return tmp_path


def test_without_credentials_the_read_fails_in_one_line_saying_401_and_what_to_do(
        locked, home: Path, shards: Path) -> None:
    for url in (f"{locked.url}/manifest.json",
                locked.url.replace("//", f"//{USER}:wrong-{PASSWORD}@") + "/manifest.json"):
        with pytest.raises(ShardError) as failure:
            read_url(url, timeout=10, retries=3)
        message = str(failure.value)
        assert message == (f"cannot read {redact(url)} (curl exit 22, HTTP 401 Unauthorized: the "
                           f"server wants credentials: put them in ~/.netrc or set "
                           f"{AUTHORIZATION_ENV} (README.md, \"Shards on a web server or object "
                           f"storage\"))")
        assert PASSWORD not in message
    assert locked.count("/manifest.json") == 0  # refused before the file was looked at


def test_netrc_credentials_read(locked, home: Path, shards: Path) -> None:
    netrc = home / ".netrc"
    netrc.write_text(f"machine 127.0.0.1 login {USER} password {PASSWORD}\n")
    netrc.chmod(0o600)
    assert read_url(f"{locked.url}/manifest.json") == (shards / "manifest.json").read_bytes()
    with open_url(f"{locked.url}/train/shard-000000.tar", timeout=10) as stream:
        assert stream.read() == (shards / "train/shard-000000.tar").read_bytes()


def test_authorization_header_from_the_environment_reads_off_the_command_line(
        locked, home: Path, shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AUTHORIZATION_ENV, basic_authorization(USER, PASSWORD))
    with open_url(f"{locked.url}/train/shard-000000.tar", timeout=10) as stream:
        assert stream.read() == (shards / "train/shard-000000.tar").read_bytes()
    command = curl_command_line(f"{locked.url}/{STALLED}", locked)
    header = basic_authorization(USER, PASSWORD).split()[1]
    assert b"curl" in command and header.encode() not in command, command


def test_a_password_in_the_url_reads_and_stays_off_curls_command_line(
        locked, home: Path, shards: Path) -> None:
    url = locked.url.replace("//", f"//{USER}:{PASSWORD}@")
    with open_url(f"{url}/train/shard-000000.tar", timeout=10) as stream:
        assert stream.read() == (shards / "train/shard-000000.tar").read_bytes()
    command = curl_command_line(f"{url}/{STALLED}", locked)
    assert b"curl" in command and PASSWORD.encode() not in command, command


def test_a_vocabulary_reused_from_a_signed_url_leaves_its_credentials_out_of_the_set(
        locked, home: Path, tmp_path: Path) -> None:
    url = locked.url.replace("//", f"//{USER}:{PASSWORD}@") + f"/vocab.json?{signed(PASSWORD)}"
    jsonl = generate(tmp_path / "source", 4, 2, seed=0, image_size=64)
    command = f"defrag featurize jsonl {jsonl} --vocab {url} --out {tmp_path / 'out'}"
    featurize(read_jsonl(jsonl, jsonl.parent, "train"),
              Settings(out=tmp_path / "out", parser="spacy", boxes="given", workers=1,
                       vocab=url, command=command))
    manifest = (tmp_path / "out" / "manifest.json").read_text()
    assert redact(url) in manifest
    assert files_holding(tmp_path / "out", PASSWORD) == []
    assert locked.log[-1] == "/vocab.json" and locked.queries[-1] == signed(PASSWORD)  # as signed


def test_img2dataset_shards_at_a_signed_url_leave_no_credential_in_the_featurized_set(
        home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """The task's plan (parts/plan.json), the parts and the merged manifest record the command
    and its input URL, a password and each signed-URL token masked."""
    write_img2dataset(tmp_path / "in", count=2, per_shard=2, image_size=64)
    with serve_folder(tmp_path / "in", basic_auth=f"{USER}:{SECRET}") as server:
        url = server.url.replace("//", f"//{USER}:{SECRET}@") + f"/00000.tar?{signed(SECRET)}"
        assert featurize_command(["webdataset", "--shards", url, "--out", str(tmp_path / "out"),
                                  "--parser", "spacy", "--boxes", "fullframe", "--workers", "1",
                                  "--min-word-count", "1"]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert redact(url) in manifest["created_by"]["command"] and MASK in redact(url)
    assert (tmp_path / "out" / "parts" / "plan.json").is_file()
    assert files_holding(tmp_path / "out") == []
    assert SECRET not in "".join(capsys.readouterr()) + caplog.text


@pytest.mark.parametrize("mark", ["\n", "\r", "\0"])
@pytest.mark.parametrize("where", ["path", "user name (percent-encoded)"])
def test_a_url_holding_a_line_break_or_nul_is_refused_before_curl_reads_what_it_injects(
        mark: str, where: str, home: Path, tmp_path: Path) -> None:
    secret, written = tmp_path / "secret", tmp_path / "written"
    secret.write_text("local file contents")
    injected = f"{mark}url = file://{secret}{mark}output = {written}{mark}"
    url = (f"http://{USER}:{PASSWORD}@127.0.0.1:9/x{injected}" if where == "path"
           else f"http://{quote('u' + injected, safe='')}:{PASSWORD}@127.0.0.1:9/x")
    with pytest.raises(ShardError) as failure, open_url(url, timeout=10) as stream:
        stream.read()
    assert str(failure.value) == (
        f"refusing the URL {redact(url)!r}: it holds a line break or a NUL character, which no "
        f"shard or manifest URL has; check where it came from (a manifest's shard \"file\", "
        f"data.shards, data.manifest)")
    assert PASSWORD not in str(failure.value) and not written.exists()


def test_an_authorization_header_with_a_line_break_is_refused_before_curl_reads_it(
        home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written = tmp_path / "written"
    monkeypatch.setenv(AUTHORIZATION_ENV, f"Bearer {PASSWORD}\noutput = {written}")
    with pytest.raises(ShardError) as failure, open_url("http://127.0.0.1:9/x", timeout=10) as s:
        s.read()
    assert str(failure.value) == (
        f"refusing {AUTHORIZATION_ENV}: it holds a line break or a NUL character, which would "
        f"add curl settings; set it to the one header value (e.g. `Bearer <token>`)")
    assert not written.exists()


def test_a_manifest_whose_shard_file_is_not_a_shard_name_is_refused_in_one_line(
        shards: Path, tmp_path: Path) -> None:
    manifest = json.loads((shards / "manifest.json").read_text())
    bad = f"train/x\nurl = file://{tmp_path / 'secret'}\noutput = {tmp_path / 'written'}"
    manifest["splits"]["train"]["shards"][1]["file"] = bad
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with serve_folder(tmp_path) as server, pytest.raises(ShardError) as failure:
        locate_split(server.url, "train", timeout=10, retries=0)
    where = f"{server.url}/manifest.json"
    assert str(failure.value) == (
        f"the manifest {where} lists shard {bad!r} (split 'train', entry 1), which holds a "
        f"control character: a shard name is a path inside the set's folder; re-run the "
        f"featurizer command of the manifest (created_by) with the same --out, or fetch the set "
        f"from a source you trust")
    assert not (tmp_path / "written").exists()


@pytest.mark.parametrize(("bad", "reason"), [
    ("../shard-000000.tar", "an empty, '.' or '..' path part"),
    ("train/../../shard-000000.tar", "an empty, '.' or '..' path part"),
    ("train//shard-000000.tar", "an empty, '.' or '..' path part"),
    ("/etc/x.tar", "an absolute path"),
    ("http://x/y.tar", "a URL scheme or a pipe: command"),
    ("pipe:cat x", "a URL scheme or a pipe: command")])
def test_a_manifest_whose_shard_name_leaves_the_set_is_refused_in_one_line(
        shards: Path, tmp_path: Path, bad: str, reason: str) -> None:
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["splits"]["val"]["shards"][0]["file"] = bad
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError) as failure:
        locate_split(str(tmp_path), "train")
    assert str(failure.value) == (
        f"the manifest {tmp_path / 'manifest.json'} lists shard {bad!r} (split 'val', entry 0), "
        f"which holds {reason}: a shard name is a path inside the set's folder; re-run the "
        f"featurizer command of the manifest (created_by) with the same --out, or fetch the set "
        f"from a source you trust")


@pytest.mark.parametrize("split", ["val 2014", "a:b", "val%20x"])
def test_a_manifest_whose_split_name_has_spaces_or_colons_is_read_from_a_folder_and_a_url(
        shards: Path, tmp_path: Path, split: str) -> None:
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["splits"][split] = manifest["splits"].pop("val")
    for entry in manifest["splits"][split]["shards"]:
        entry["file"] = entry["file"].replace("val/", f"{split}/")
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    shutil.copytree(shards / "val", tmp_path / split)
    with serve_folder(tmp_path) as server:
        for spec in (str(tmp_path), server.url):
            found = locate_split(spec, split, timeout=10, retries=0)
            assert len(found.shards) == 2
            with open_url(found.shards[1].url, timeout=10) as stream:
                assert stream.read() == (shards / "val/shard-000001.tar").read_bytes()


# ---------------------------------------------------------------------------------------------
# End to end


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_training_and_its_evaluation_keep_the_password_out_of_everything(
        shards: Path, tmp_path: Path) -> None:
    secret = f"SECRET{uuid.uuid4().hex}"
    with serve_folder(shards, basic_auth=f"{USER}:{secret}") as server:
        url = server.url.replace("//", f"//{USER}:{secret}@")
        config = tiny_config(tmp_path, shards)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
        env.pop("MLFLOW_TRACKING_URI", None)
        env.pop(AUTHORIZATION_ENV, None)
        training = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
             "-m", "trainer.main", "--config", str(config), f"data.shards={url}",
             "optim.epochs=1", "optim.anneal_last_epochs=0"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
        assert training.returncode == 0, training.stderr[-4000:]
        run_dir = tmp_path / "run"
        evaluation = subprocess.run(
            [DEFRAG, "evaluate", "--model", str(run_dir / "best"),
             "--shards", url, "--split", "val", "--workers", "1"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert evaluation.returncode == 0, evaluation.stderr[-4000:]
    summary = json.loads(training.stdout.strip().splitlines()[-1])
    params = MlflowClient(summary["tracking_uri"]).get_run(summary["mlflow_run_id"]).data.params
    assert params["data.shards"] == f"{server.url.replace('//', f'//{USER}:{MASK}@')}"
    assert json.loads(evaluation.stdout.strip().splitlines()[-1])["shards"] == redact(url)
    for name, text in [("training stdout", training.stdout), ("training stderr", training.stderr),
                       ("evaluation stdout", evaluation.stdout),
                       ("evaluation stderr", evaluation.stderr)]:
        assert secret not in text, name
    files = [path for path in run_dir.rglob("*") if path.is_file()]
    assert any(path.name == "mlflow.db" for path in files)
    assert [path for path in files if secret.encode() in path.read_bytes()] == []

"""Streaming training (``peagle train --stream``): producers run the target and send finished rows straight to the
trainer, with no files between them.

Processes and transport. One trainer (rank 0) and P producers (ranks 1..P) form one ``torch.distributed`` gloo
process group: ``peagle train --stream --producers P`` starts the producers itself on one machine (spawned processes,
a rendezvous on a free local port), and ``torchrun`` starts the same code on several machines (rank 0 trains, every
other rank produces; ``--producers`` must be the world size - 1). Rows travel as point-to-point tensor messages
(``send`` / ``recv``): a header, then the row's bytes. No file holds a hidden state.

A producer answers its share of the prompts (record i goes to producer i % P) with :mod:`peagle.train.regenerate`,
tokenizes the answered records as ``prepare-data`` does, packs them into rows of ``--seq-len``
(:class:`peagle.train.data.RowPacker`), runs the target over each row's documents as ``extract`` does
(:func:`peagle.train.extract.row_states`, the states rounded to ``--states-dtype``) and sends the row. It goes over the
prompts again and again (pass e seeds its sampled answers with e) until the trainer says stop.

Backpressure and memory. The trainer receives each producer's rows in a thread of its own into a queue of
``--queue-rows`` Q rows; a full queue stops that thread, and a gloo ``send`` returns only once the receiver has taken
the message, so a producer blocks on its next row. A producer answers a whole chunk of records before it sends the
chunk's first row, so Q must hold about a chunk's rows for the two sides to overlap: with a queue of a few rows the
producer waits for the trainer to take the chunk's rows, then the trainer waits for the next chunk's answers, and their
times add up instead (the default, 64, holds a chunk of the default 64 records of up to T tokens each). Rows in the
trainer's memory: at most P x (Q + 1) in transit (Q queued and one held by each receiving thread) plus the micro-batch
it trains; a producer holds the rows of one regeneration chunk (``--regen-batch-size`` records) and the row it is
sending. A row is T x (4 + 1 + 4 + (A + 1) x H x s) bytes (T = --seq-len, A aux layers of width H, s bytes per state).

Order and reproducibility. The trainer takes rows round robin: slot j of the run is the next row of producer j % P.
The order depends on the data only, not on timing; with one producer it is the order of ``regenerate`` ->
``prepare-data`` -> ``extract``, so with greedy answers the stream trains the drafter ``train --row-order stored``
trains from those files, bit for bit (a test checks it).

Resume. Every row carries its producer's cursor after it: (pass, record, piece of that record's document) where the
next row starts. A checkpoint records, per producer, the cursor after the last row of its last complete step;
``--resume`` hands the cursors to the producers, which regenerate from there, so no row is trained twice or skipped.

Failures. A producer that dies (its connection closes), reports an error (a bad record) or does not match the
trainer's target and tokenizer at connect time (vocabulary, hidden size, aux layers, tokenizer) is named in the error
the trainer stops with. The trainer then saves the checkpoint of its last complete step (nothing it did not train)
and stops the other producers; restart and continue with ``--resume``. A producer whose trainer is gone exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib
import json
import math
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from peagle.model.target import read_target_tensors
from peagle.train.data import RowPacker, load_tokenizer, tokenize_record
from peagle.train.dataset import MemoryRows, TrainRow, raw_row
from peagle.train.extract import DTYPES, open_backend, open_target, row_states, target_fields
from peagle.train.regenerate import (
    Cancelled,
    HFAnswerer,
    Sampling,
    chunks,
    open_generator,
    read_prompt_records,
    regenerate_chunk,
)

__all__ = [
    "LocalProducers",
    "Producer",
    "ProducerFailed",
    "RowLayout",
    "StreamArgs",
    "StreamSource",
    "check_resume",
    "describe",
    "launch_producers",
    "mismatch",
    "run_producer",
    "stream_ranks",
]


def _option(default: Any = None, help: str = "", *, flag: str | None = None) -> Any:
    return field(default=default, metadata={"help": help, "flag": flag, "hidden": False})


@dataclass
class StreamArgs:
    """Settings of ``peagle train --stream`` (the producers, the stream and the answers; each field's metadata holds
    its option). ``--data`` is then the prompts, as ``peagle regenerate`` reads them."""

    target: str | None = _option(help="--stream: the target model directory (producers run it, the trainer checks it)")
    tokenizer: str | None = _option(help="--stream: the target's tokenizer (default: --target)")
    producers: int = _option(1, "--stream: producer processes (under torchrun: the world size - 1)")
    producer_backend: Literal["hf", "vllm"] = _option(
        "hf", "--stream: the producers' target: hf (transformers in the producer) or vllm"
    )
    queue_rows: int = _option(
        64,
        "--stream: rows the trainer holds per producer (the bounded queue); at least a --regen-batch-size chunk's rows "
        "let a producer answer its next chunk while the trainer trains on this one",
    )
    seq_len: int = _option(2048, "--stream: positions T of a packed row")
    aux_layers: list[int] | None = _option(  # noqa: RUF009 (_option() returns a field, not a shared list)
        None, "--stream: aux target layer ids, e.g. 2,16,29 (default: early, middle, late as vLLM: 2, L/2, L-3)"
    )
    states_dtype: Literal["bfloat16", "float16", "float32", "float64"] = _option(
        "bfloat16", "--stream: dtype of the hidden states a row carries (as extract's --dtype)"
    )
    max_new_tokens: int = _option(256, "--stream: tokens per answer")
    temperature: float = _option(0.0, "--stream: answer sampling temperature, 0 = greedy")
    top_p: float = _option(1.0, "--stream: nucleus sampling mass of the answers")
    regen_seed: int = _option(0, "--stream: seed of the sampled answers (regenerate's --seed)")
    ignore_eos: bool = _option(False, "--stream: answers do not end at the end-of-sequence token")
    regen_batch_size: int = _option(64, "--stream: records a producer answers together (regenerate's --batch-size)")
    max_records: int | None = _option(None, "--stream: use the first N prompt records only")
    eval_input: str | None = _option(
        None, "--stream: held-out prompts; producer 1 answers them first, the trainer keeps --eval-rows rows in memory"
    )
    stream_timeout: float = _option(3600.0, "--stream: seconds a process waits for a message before giving up")

    def sampling(self) -> Sampling:
        return Sampling(self.max_new_tokens, self.temperature, self.top_p, self.regen_seed, self.ignore_eos)

    def check(self) -> None:
        """ValueError naming the option of the first bad setting (before any work)."""
        if not self.target:
            raise ValueError("--stream needs --target (the target model directory)")
        for flag, ok, expected, value in (
            ("--producers", self.producers >= 1, "at least 1", self.producers),
            ("--queue-rows", self.queue_rows >= 1, "at least 1", self.queue_rows),
            ("--seq-len", 4 <= self.seq_len <= 1 << 20, "in [4, 2^20]", self.seq_len),
            ("--regen-batch-size", self.regen_batch_size >= 1, "at least 1", self.regen_batch_size),
            ("--max-records", self.max_records is None or self.max_records >= 1, "at least 1", self.max_records),
            ("--stream-timeout", 0 < self.stream_timeout < float("inf"), "positive", self.stream_timeout),
        ):
            if not ok:
                raise ValueError(f"{flag} must be {expected}, got {value!r}")
        self.sampling().check()
        for flag, path in (
            ("--target", self.target),
            ("--tokenizer", self.tokenizer),
            ("--eval-input", self.eval_input),
        ):
            if path and not path.startswith("hf:") and not Path(path).exists():
                raise FileNotFoundError(f"{flag} {path} does not exist")


# Settings a --resume may change: they do not change which rows come or what a step computes.
RESUME_FREE = ("queue_rows", "stream_timeout", "target", "tokenizer", "producer_backend", "eval_input")

# Message kinds (header[0]) and tags. Producer -> trainer: a header [8] int64 on HEADER, then the row's bytes on
# PAYLOAD or a UTF-8 text on TEXT; trainer -> producer: a header on CONTROL, then a text on CONTROL_TEXT.
HELLO, ROW, EVAL, EVAL_END, ERROR, START, REFUSE, STOP = range(1, 9)
HEADER_TAG, PAYLOAD_TAG, TEXT_TAG, CONTROL_TAG, CONTROL_TEXT_TAG = range(11, 16)
# The description fields a producer and the trainer must agree on, with their names in errors.
MATCHED = {
    "vocab_size": "target vocabulary",
    "tokenizer_size": "tokenizer size",
    "tokenizer_digest": "tokenizer vocabulary digest",
    "hidden_size": "hidden size",
    "num_target_layers": "target layers",
    "aux_layer_ids": "aux layers",
    "model_type": "target model_type",
    "settings": "stream settings",
}


class ProducerFailed(RuntimeError):
    """A producer died, reported an error, or was refused; the message names it."""


def stream_ranks() -> tuple[int, int] | None:
    """(rank, world size) under torchrun (RANK / WORLD_SIZE set), else None (one machine: the trainer starts the
    producers)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def _tokenizer_digest(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def _settings(stream: StreamArgs) -> dict[str, Any]:
    """What both sides must share to agree on the rows (the paths may differ between machines)."""
    keep = ("seq_len", "states_dtype", "max_new_tokens", "temperature", "top_p", "regen_seed", "ignore_eos")
    return {k: getattr(stream, k) for k in (*keep, "regen_batch_size", "max_records")}


def describe(stream: StreamArgs, tokenizer, target, role: str) -> dict[str, Any]:
    """The description a side sends or checks at connect time: where it runs, its target and tokenizer."""
    cfg = target.config
    return {
        "role": role,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "target": str(Path(stream.target).resolve()),
        "tokenizer": str(Path(stream.tokenizer or stream.target).resolve()),
        "vocab_size": cfg.vocab_size,
        "tokenizer_size": len(tokenizer),
        "tokenizer_digest": _tokenizer_digest(tokenizer),
        "hidden_size": cfg.hidden_size,
        "num_target_layers": cfg.num_hidden_layers,
        "aux_layer_ids": list(target.layer_ids),
        "model_type": cfg.model_type,
        "settings": _settings(stream),
    }


def mismatch(producer: dict[str, Any], trainer: dict[str, Any], rank: int) -> str | None:
    """The refusal naming both sides, or None when the producer fits the trainer."""
    differences = [
        f"{name}: {producer.get(key)!r} (producer) vs {trainer[key]!r} (trainer)"
        for key, name in MATCHED.items()
        if producer.get(key) != trainer[key]
    ]
    if not differences:
        return None
    side = lambda d: f"{d['host']} pid {d['pid']}, target {d['target']}, tokenizer {d['tokenizer']}"  # noqa: E731
    return f"producer {rank} ({side(producer)}) does not match the trainer ({side(trainer)}): " + "; ".join(differences)


# ---------------------------------------------------------------------------------------------------------------------
# Messages


def _send_text(kind: int, text: str, dst: int, header_tag: int, text_tag: int) -> None:
    """A header of ``kind`` whose [1] is the text's length, then the UTF-8 text (when not empty)."""
    data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else torch.zeros(0, dtype=torch.uint8)
    header = torch.zeros(8, dtype=torch.int64)
    header[0], header[1] = kind, data.numel()
    dist.send(header, dst, tag=header_tag)
    if data.numel():
        dist.send(data, dst, tag=text_tag)


def _recv_text(length: int, src: int, tag: int) -> str:
    if not length:
        return ""
    data = torch.empty(length, dtype=torch.uint8)
    dist.recv(data, src, tag=tag)
    return data.numpy().tobytes().decode()


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.empty((), dtype=dtype).element_size() * math.prod(shape)


@dataclass(frozen=True)
class RowLayout:
    """The fixed byte layout of one row message: input_ids int32 [T], loss_mask uint8 [T], document_ids int32 [T],
    aux_hidden [T, A x H] and final_hidden [T, H] in the states dtype."""

    seq_len: int
    aux_width: int
    hidden: int
    dtype: torch.dtype

    def parts(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        t = self.seq_len
        return [
            ("input_ids", torch.int32, (t,)),
            ("loss_mask", torch.uint8, (t,)),
            ("document_ids", torch.int32, (t,)),
            ("aux_hidden", self.dtype, (t, self.aux_width)),
            ("final_hidden", self.dtype, (t, self.hidden)),
        ]

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(dtype, shape) for _, dtype, shape in self.parts())

    def pack(self, row: dict[str, Tensor]) -> Tensor:
        return torch.cat(
            [row[name].to(dtype).contiguous().view(torch.uint8).flatten() for name, dtype, _ in self.parts()]
        )

    def unpack(self, data: Tensor) -> dict[str, Tensor]:
        out, start = {}, 0
        for name, dtype, shape in self.parts():
            count = _nbytes(dtype, shape)
            out[name] = data[start : start + count].view(dtype).view(shape)
            start += count
        return out


# ---------------------------------------------------------------------------------------------------------------------
# The trainer's side


@dataclass
class _ProducerState:
    rank: int
    description: dict[str, Any]
    queue: queue.Queue
    cursor: list[int]  # after the last row taken: (pass, record, piece)
    progress: float = 0.0  # passes over its prompts, fractional
    rows: int = 0  # rows taken
    committed: dict[str, Any] = field(default_factory=dict)  # cursor and rows at the last complete step


class StreamSource:
    """The trainer's end of the stream: its own description of the target (from ``--target``, never from a producer),
    the manifest and target head a file run reads from an extract directory, and the producers' rows by slot."""

    def __init__(self, stream: StreamArgs) -> None:
        self.stream = stream
        self.tokenizer = load_tokenizer(stream.tokenizer or stream.target)
        self.target = open_target(stream.target, stream.aux_layers, stream.seq_len, "cpu")
        self.description = describe(stream, self.tokenizer, self.target, "trainer")
        cfg = self.target.config
        self.manifest: dict[str, Any] = {
            "kind": "peagle-extracted",
            "target": str(Path(stream.target).resolve()),
            "data": None,
            "aux_layer_ids": list(self.target.layer_ids),
            "dtype": stream.states_dtype,
            "seq_len": stream.seq_len,
            **target_fields(self.target.full_config),
        }
        if len(self.tokenizer) > cfg.vocab_size:
            raise ValueError(
                f"the tokenizer has {len(self.tokenizer)} tokens but the target's vocabulary is {cfg.vocab_size}"
            )
        names = {"lm_head.weight": "lm_head.weight", "embed_tokens.weight": "embed_tokens.weight"}
        self.head = {k: v.float() for k, v in read_target_tensors(stream.target, names).items()}
        self.layout = RowLayout(
            stream.seq_len, len(self.target.layer_ids) * cfg.hidden_size, cfg.hidden_size, DTYPES[stream.states_dtype]
        )
        self.producers: list[_ProducerState] = []
        self.eval_rows: MemoryRows | None = None
        self._next_slot = 0

    # -- connect ------------------------------------------------------------------------------------------------------

    def connect(self, resumed: dict[str, Any] | None, first_slot: int, eval_rows: int) -> None:
        """Forms the process group with the producers, checks each one's description (a mismatch: every producer is
        refused and ValueError names both sides), hands each its start cursor (from ``resumed``, a checkpoint's
        :meth:`state`; the run goes on at slot ``first_slot``), and receives the first ``eval_rows`` held-out rows
        from producer 1 when ``--eval-input`` is given (0: none)."""
        stream = self.stream
        cursors = resumed["cursors"] if resumed else None
        self._next_slot = first_slot
        world = stream.producers + 1
        dist.init_process_group("gloo", rank=0, world_size=world, timeout=timedelta(seconds=stream.stream_timeout))
        hellos = {}
        for rank in range(1, world):
            header = torch.zeros(8, dtype=torch.int64)
            try:
                dist.recv(header, rank, tag=HEADER_TAG)
                text = _recv_text(int(header[1]), rank, TEXT_TAG)
            except RuntimeError as err:
                raise ProducerFailed(f"producer {rank} stopped before it connected: {str(err)[:300]}") from err
            if int(header[0]) != HELLO:
                raise ProducerFailed(f"producer {rank} failed before it connected: {text}")
            hellos[rank] = json.loads(text)
        problems = [m for rank, d in hellos.items() if (m := mismatch(d, self.description, rank)) is not None]
        if problems:
            for rank in hellos:
                _send_text(REFUSE, problems[0], rank, CONTROL_TAG, CONTROL_TEXT_TAG)
            raise ValueError("; ".join(problems))
        for rank in range(1, world):
            cursor = (cursors or {}).get(str(rank), [0, 0, 0])
            start = {"cursor": cursor, "eval_rows": eval_rows if rank == 1 and stream.eval_input else 0}
            _send_text(START, json.dumps(start), rank, CONTROL_TAG, CONTROL_TEXT_TAG)
            state = _ProducerState(rank, hellos[rank], queue.Queue(maxsize=stream.queue_rows), list(cursor))
            state.rows = resumed["rows"][str(rank)] if resumed else 0
            state.committed = {"cursor": list(cursor), "rows": state.rows}
            self.producers.append(state)
            threading.Thread(target=self._receive, args=(state,), daemon=True, name=f"peagle-recv-{rank}").start()
        if eval_rows and stream.eval_input:
            rows = []
            while True:
                kind, header, payload = self._take(self.producers[0])
                if kind == EVAL_END:
                    break
                rows.append({k: v.clone() for k, v in self.layout.unpack(payload).items()})
            if not rows:
                raise ValueError(f"--eval-input {stream.eval_input}: the producer found no held-out row to train on")
            self.eval_rows = MemoryRows(self.manifest, self.head, rows)

    def _receive(self, state: _ProducerState) -> None:
        """One producer's messages into its queue (blocks when the queue is full: the producer's send waits)."""
        try:
            while True:
                header = torch.zeros(8, dtype=torch.int64)
                dist.recv(header, state.rank, tag=HEADER_TAG)
                kind = int(header[0])
                if kind in (ROW, EVAL):
                    payload = torch.empty(self.layout.nbytes, dtype=torch.uint8)
                    dist.recv(payload, state.rank, tag=PAYLOAD_TAG)
                    state.queue.put((kind, header, payload))
                elif kind == EVAL_END:
                    state.queue.put((kind, header, None))
                else:  # ERROR
                    state.queue.put((kind, header, _recv_text(int(header[1]), state.rank, TEXT_TAG)))
                    return
        except Exception as err:  # the connection closed: the producer died (or the group is torn down)
            state.queue.put((None, None, f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"))

    def _name(self, state: _ProducerState) -> str:
        d = state.description
        return f"producer {state.rank} ({d['host']} pid {d['pid']})"

    def _take(self, state: _ProducerState) -> tuple[int, Tensor, Any]:
        kind, header, payload = state.queue.get()
        if kind is None:
            raise ProducerFailed(f"{self._name(state)} stopped sending: {payload}")
        if kind == ERROR:
            raise ProducerFailed(f"{self._name(state)} failed: {payload}")
        return kind, header, payload

    # -- rows ---------------------------------------------------------------------------------------------------------

    def row(self, slot: int, device: torch.device) -> TrainRow:
        """The row of ``slot``: slots are taken in order, slot j from producer j % P (blocks until it arrives)."""
        if slot != self._next_slot:
            raise RuntimeError(f"stream rows are taken in order: slot {slot} asked, {self._next_slot} next")
        state = self.producers[slot % len(self.producers)]
        kind, header, payload = self._take(state)
        if kind != ROW:
            raise ProducerFailed(f"{self._name(state)} sent message kind {kind} where a row was due")
        self._next_slot += 1
        state.rows += 1
        state.cursor = header[1:4].tolist()
        total = int(header[4])
        state.progress = float(header[1]) + (float(header[2]) / total if total > 0 else 0.0)
        return TrainRow(*(t.to(device) for t in raw_row(self.layout.unpack(payload))))

    def commit(self) -> None:
        """Marks every row taken so far as trained (called after each complete step)."""
        for state in self.producers:
            state.committed = {"cursor": list(state.cursor), "rows": state.rows}

    def state(self) -> dict[str, Any]:
        """What a checkpoint records: per producer the cursor after its last trained row and its trained rows."""
        return {
            "producers": len(self.producers),
            "cursors": {str(s.rank): s.committed["cursor"] for s in self.producers},
            "rows": {str(s.rank): s.committed["rows"] for s in self.producers},
            "args": asdict(self.stream),
        }

    def epoch(self) -> float:
        """Passes over the prompts so far (mean over producers; the fraction once a pass has counted them)."""
        return sum(s.progress for s in self.producers) / max(1, len(self.producers))

    def stop(self, grace: float = 60.0) -> None:
        """Tells every producer to stop (a dead one is skipped), takes what they still send until each closes its
        connection (up to ``grace`` seconds), then leaves the process group."""
        for state in self.producers:
            with contextlib.suppress(Exception):
                _send_text(STOP, "", state.rank, CONTROL_TAG, CONTROL_TEXT_TAG)
        deadline = time.monotonic() + grace
        threads = [t for t in threading.enumerate() if t.name.startswith("peagle-recv-")]
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            for state in self.producers:  # a full queue holds its thread (and the producer's send) back
                with contextlib.suppress(queue.Empty):
                    while True:
                        state.queue.get_nowait()
            time.sleep(0.05)
        if dist.is_initialized() and not any(t.is_alive() for t in threads):
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------------
# The producer's side


class _Stopped(Exception):
    pass


class Producer:
    """One producer process: answers its share of the prompts, packs and extracts rows, sends them."""

    def __init__(self, rank: int, world: int, data: str, stream: StreamArgs, device: str) -> None:
        self.rank, self.world, self.data, self.stream, self.device = rank, world, data, stream, device
        self.stop = threading.Event()
        self.trainer_gone: str | None = None

    def _control(self) -> None:
        header = torch.zeros(8, dtype=torch.int64)
        try:
            dist.recv(header, 0, tag=CONTROL_TAG)
            self.stop.set()  # STOP (the only message after START)
        except Exception as err:
            self.trainer_gone = str(err).splitlines()[0][:300]
            self.stop.set()

    def _check(self) -> None:
        if self.stop.is_set():
            raise _Stopped

    def run(self) -> int:
        """Connects, produces until stopped, leaves the process group; the exit code (0: the trainer stopped it)."""
        dist.init_process_group(
            "gloo", rank=self.rank, world_size=self.world, timeout=timedelta(seconds=self.stream.stream_timeout)
        )
        code = self._connect_and_produce()
        if code == 2 and not self.trainer_gone:
            self.stop.wait(30)  # the trainer answers a reported error with STOP
        if self.trainer_gone:
            print(f"[peagle producer {self.rank}] the trainer is gone: {self.trainer_gone}", file=sys.stderr)
            return 1
        if self.stop.is_set():  # the control thread is done: nothing of ours is inside gloo any more
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        return code

    def _connect_and_produce(self) -> int:
        stream = self.stream
        try:
            tokenizer = load_tokenizer(stream.tokenizer or stream.target)
            target = open_target(stream.target, stream.aux_layers, stream.seq_len, self.device, stream.producer_backend)
        except (OSError, ValueError) as err:
            self._fail(f"cannot open the target: {err}")
            return 2
        _send_text(HELLO, json.dumps(describe(stream, tokenizer, target, "producer")), 0, HEADER_TAG, TEXT_TAG)
        header = torch.zeros(8, dtype=torch.int64)
        dist.recv(header, 0, tag=CONTROL_TAG)
        text = _recv_text(int(header[1]), 0, CONTROL_TEXT_TAG)
        if int(header[0]) == REFUSE:
            print(f"[peagle producer {self.rank}] refused by the trainer: {text}", file=sys.stderr, flush=True)
            self.stop.set()
            return 2
        start = json.loads(text)
        threading.Thread(target=self._control, daemon=True, name="peagle-control").start()
        if self.device == "cpu":
            torch.set_flush_denormal(True)
        states = open_backend(target, stream.producer_backend)
        answerer = None
        try:
            # The transformers backend answers with the model the states come from (one copy of the weights).
            answerer = (
                HFAnswerer(states.model, self.device)
                if stream.producer_backend == "hf"
                else open_generator(stream.producer_backend, stream.target, self.device, max_len=stream.seq_len)
            )
            if isinstance(answerer, HFAnswerer):
                answerer.cancel = self.stop  # a STOP ends a long generation at its next token
            cfg = target.config
            self.layout = RowLayout(
                stream.seq_len, len(target.layer_ids) * cfg.hidden_size, cfg.hidden_size, DTYPES[stream.states_dtype]
            )
            self.work = (tokenizer, answerer, states, len(target.layer_ids), cfg.hidden_size)
            if start["eval_rows"]:
                self._send_eval(start["eval_rows"])
            self._produce(start["cursor"])
        except (_Stopped, Cancelled):
            pass
        except (ValueError, OSError) as err:  # bad input: the trainer reports it by name
            if not self.stop.is_set():
                self._fail(str(err))
                return 2
        except RuntimeError as err:  # a send failed: the trainer is gone, or stopped us while we sent
            if not self.stop.is_set():
                self.trainer_gone = str(err).splitlines()[0][:300]
        finally:
            if answerer is not None and answerer is not states:
                answerer.close()
            states.close()
        return 0

    def _fail(self, message: str) -> None:
        with contextlib.suppress(Exception):
            _send_text(ERROR, message, 0, HEADER_TAG, TEXT_TAG)
        print(f"[peagle producer {self.rank}] {message}", file=sys.stderr, flush=True)

    def _rows(self, source: str, shard: tuple[int, int], epoch: int, cursor: Sequence[int]) -> Iterator[Any]:
        """(row tensors, cursor after it) of one pass over ``source`` from ``cursor`` (record, piece); the pass's
        last, partly filled row comes with cursor None."""
        tokenizer, answerer, *_ = self.work
        packer = RowPacker(self.stream.seq_len)
        first_record, first_piece = cursor
        records = read_prompt_records(source, self.stream.max_records, shard)
        for chunk in chunks(records, self.stream.regen_batch_size):
            if chunk[-1][0] < first_record:
                continue  # whole chunks before the cursor (chunks stay aligned as regenerate forms them)
            self._check()
            answered = regenerate_chunk(chunk, tokenizer, answerer, self.stream.sampling(), epoch)
            for (index, where, _), record in zip(chunk, answered, strict=True):
                if index < first_record:
                    continue
                try:
                    document = tokenize_record(tokenizer, record)
                except ValueError as err:
                    raise ValueError(f"{where}: {err}") from err
                if not any(document.loss):
                    continue  # nothing to train, as prepare-data skips it
                piece = first_piece if index == first_record else 0
                yield from packer.add(document, index, piece)
        last = packer.finish()
        if last is not None:
            yield last, None

    def _states(self, row: tuple[Tensor, Tensor, Tensor]) -> dict[str, Tensor]:
        _, _, states, num_aux, hidden = self.work
        ids, loss, docs = (t.clone() for t in row)
        prepared = {"input_ids": ids, "loss_mask": loss, "document_ids": docs}
        self._check()
        ((aux, final),) = row_states(states, [prepared], num_aux, hidden)
        return {**prepared, "aux_hidden": aux, "final_hidden": final}

    def _send_row(self, kind: int, row: dict[str, Tensor], header_values: Sequence[int]) -> None:
        self._check()
        header = torch.zeros(8, dtype=torch.int64)
        header[0] = kind
        header[1 : 1 + len(header_values)] = torch.tensor(list(header_values), dtype=torch.int64)
        dist.send(header, 0, tag=HEADER_TAG)
        dist.send(self.layout.pack(row), 0, tag=PAYLOAD_TAG)

    def _send_eval(self, count: int) -> None:
        for sent, (row, _) in enumerate(self._rows(self.stream.eval_input, (0, 1), 0, (0, 0)), 1):
            self._send_row(EVAL, self._states(row), [0, 0, 0, -1])
            if sent == count:
                break
        _send_text(EVAL_END, "", 0, HEADER_TAG, TEXT_TAG)

    def _produce(self, cursor: Sequence[int]) -> None:
        """Rows from ``cursor`` (pass, record, piece) on, pass after pass, each sent with the cursor after it and the
        records of the data (for the trainer's epoch count; -1 for a hub dataset, not counted)."""
        epoch, record, piece = cursor
        shard = (self.rank - 1, self.world - 1)
        total = (
            -1
            if self.data.startswith("hf:")
            else sum(1 for _ in read_prompt_records(self.data, self.stream.max_records))
        )
        while True:
            for row, after in self._rows(self.data, shard, epoch, (record, piece)):
                values = [epoch + 1, 0, 0, total] if after is None else [epoch, after[0], after[1], total]
                self._send_row(ROW, self._states(row), values)
            epoch, record, piece = epoch + 1, 0, 0


def run_producer(
    rank: int, world: int, data: str, stream: StreamArgs, register: Sequence[str] = (), local: bool = False
) -> int:
    """A producer process's main: imports the modules that register its backends, joins the process group (rank >=
    1) and produces until the trainer stops it. Returns the exit code (0: stopped by the trainer)."""
    if local:
        _die_with_parent()
    for module in register:
        importlib.import_module(module)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = f"cuda:{local_rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    return Producer(rank, world, data, stream, device).run()


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGTERM to this process when the process that started it dies (a killed trainer)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _producer_main(rank: int, world: int, port: int, data: str, stream: StreamArgs, register: Sequence[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.exit(run_producer(rank, world, data, stream, register, local=True))


class LocalProducers:
    """Producer processes this machine's trainer started (``peagle train --stream`` without torchrun)."""

    def __init__(self, processes: list[Any]) -> None:
        self.processes = processes

    def watch(self, connected: Callable[[], bool]) -> None:
        """Until ``connected()``: a producer that exits before the process group forms leaves the trainer waiting
        for it in the rendezvous, so the trainer process exits with that producer's code and a line naming it."""

        def check() -> None:
            while not connected():
                for rank, process in enumerate(self.processes, 1):
                    if process.exitcode is not None:
                        print(
                            f"peagle train: error: producer {rank} exited with code {process.exitcode} before it "
                            "connected (its error is above)",
                            file=sys.stderr,
                            flush=True,
                        )
                        self.join(grace=0.0)
                        os._exit(process.exitcode or 1)
                time.sleep(0.5)

        threading.Thread(target=check, daemon=True, name="peagle-watch").start()

    def join(self, grace: float = 60.0) -> None:
        """Waits up to ``grace`` seconds for the producers to exit (after the trainer stopped them), then ends the
        rest."""
        deadline = time.monotonic() + grace
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(10)
            if process.is_alive():
                process.kill()
                process.join()


def launch_producers(data: str, stream: StreamArgs, register: Sequence[str] = ()) -> LocalProducers:
    """Starts ``stream.producers`` producer processes on this machine (spawned, ranks 1..P) and points this process's
    rendezvous at a free local port (rank 0 joins it in :meth:`StreamSource.connect`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    context = torch.multiprocessing.get_context("spawn")
    world = stream.producers + 1
    processes = []
    for rank in range(1, world):
        process = context.Process(
            target=_producer_main,
            args=(rank, world, port, data, stream, tuple(register)),
            name=f"peagle-producer-{rank}",
        )
        process.start()
        processes.append(process)
    return LocalProducers(processes)


def check_resume(saved: dict[str, Any], stream: StreamArgs) -> None:
    """ValueError when a resumed stream would produce other rows than the checkpoint's run (settings differ)."""
    current = asdict(stream)
    if saved["producers"] != stream.producers:
        raise ValueError(
            f"--resume with {stream.producers} producers: the checkpoint's run had {saved['producers']} (each producer "
            "answers its share of the prompts, record i % producers)"
        )
    changed = {k: (v, current.get(k)) for k, v in saved["args"].items() if k not in RESUME_FREE and current.get(k) != v}
    if changed:
        detail = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
        raise ValueError(f"--resume with stream settings that differ from the checkpoint's ({detail})")

#!/usr/bin/env python3
"""swarm_peer.py: a stage server in Python, written from docs/protocol.md and docs/model.md.

It joins a swarm next to the C++ `swarm-stage` peers: HELLO, heartbeats, LOAD_STAGE, FORWARD,
FORWARD_LOSS, BACKWARD, EVAL, STEP, the within-stage round (ROUND_BEGIN/REDUCE/APPLY), the
state transfer (STATE_REQUEST/STATE_LOAD), typed ERRORs for bad input, BYE, and a large message
in PARTs both ways (it says so in HELLO; the router in WELCOME). It computes in
fp32 on the CPU with PyTorch (model.py), speaks only the fp32 codec (jobs with other codecs
are refused at LOAD_STAGE with a clear error), takes no peer-to-peer connections (the router
relays what it makes) and fetches referenced tensors from their holders itself.

Usage: python3 examples/python_peer/swarm_peer.py --router tcp://127.0.0.1:5555 [--stage N]
Needs Debian's python3-torch, python3-zmq, python3-msgpack, python3-xxhash.
"""
import argparse
import os
import secrets
import sys
import time

import msgpack
import numpy as np
import torch
import xxhash
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as M  # noqa: E402

VERSION, REFUSAL_VERSION = 2, 1
PART = 6
PART_BYTES, MAX_FRAMES, MAX_MESSAGE_BYTES = 64 << 10, 4096, 2 << 30
(HELLO, WELCOME, HEARTBEAT, BYE, ERROR, LOAD_STAGE, STAGE_READY, FORWARD, FORWARD_LOSS, BACKWARD, EVAL, RESULT, STEP,
 ROUND_BEGIN, ROUND_DELTA, ROUND_APPLY, ROUND_DONE, STATE_REQUEST, STATE_REPLY, STATE_LOAD, ROUND_REDUCE, ROUND_REDUCED,
 FETCH, FETCHED, RELEASE, CHAOS) = (1, 2, 3, 4, 5, 10, 11, 20, 21, 22, 23, 24, 25, 30, 31, 32, 33, 34, 35, 36, 37, 38,
                                    40, 41, 42, 57)
KNOWN = {1, 2, 3, 4, 5, 6, 10, 11, 20, 21, 22, 23, 24, 25, 30, 31, 32, 33, 34, 35, 36, 37, 38, 40, 41, 42, 50, 51, 52, 53, 54,
         55, 56, 57, 58}
MAX_TENSORS = {FORWARD: 1, FORWARD_LOSS: 2, BACKWARD: 2, EVAL: 2, RESULT: 1, ROUND_DELTA: 256, ROUND_APPLY: 256,
               STATE_REPLY: 5, STATE_LOAD: 5, ROUND_REDUCE: 4094, ROUND_REDUCED: 1, FETCHED: 1}
ERRC = {"malformed": 1, "bad_magic": 2, "bad_version": 3, "too_large": 4, "truncated": 5, "out_of_order": 6,
        "checksum": 7, "bad_tensor": 8, "unknown_type": 9, "unreachable": 10, "not_held": 11}


class WireError(Exception):
    def __init__(self, name, message, tensor=None):
        super().__init__(message)
        self.name, self.tensor = name, tensor


def log(*a):
    print(time.strftime("%H:%M:%S"), "[python-peer]", *a, file=sys.stderr, flush=True)


# ---- frames ----------------------------------------------------------------------------------

def encode(mtype, mid, body=None, tensors=(), attempt=0, version=VERSION):
    """tensors: (dtype, shape, payload bytes); every f32 tensor travels in codec fp32."""
    body = dict(body or {})
    if tensors:
        body["tensors"] = [{"dtype": d, "shape": list(s), "codec": "fp32" if d == "f32" else "raw", "nbytes": len(p),
                            "xxh64": xxhash.xxh3_64_intdigest(p)} for d, s, p in tensors]
    return [msgpack.packb(["SWRM", version, mtype, mid, attempt]), msgpack.packb(body, use_bin_type=True)] + \
        [p for _, _, p in tensors]


def split_parts(frames, part_bytes=PART_BYTES):
    """The messages that carry `frames` to the router: themselves, or PARTs when they hold more
    than part_bytes (docs/protocol.md#parts)."""
    if sum(len(f) for f in frames) <= part_bytes:
        return [frames]
    parts, cur, room = [], None, 0

    def start():
        nonlocal cur, room
        if cur is not None:
            parts.append(cur)
        header = {"frames": [len(f) for f in frames]} if not parts and cur is None else {}
        cur = [msgpack.packb(["SWRM", VERSION, PART, len(parts), 0]), msgpack.packb(header)]
        room = part_bytes

    start()
    for f in frames:
        view, at = memoryview(f), 0
        while at < len(f):
            if room == 0:
                start()
            n = min(room, len(f) - at)
            cur.append(view[at:at + n])
            at, room = at + n, room - n
    parts.append(cur)
    return parts


class PartJoiner:
    """Puts a message from the router that came in PARTs back together (docs/protocol.md#parts)."""

    def __init__(self):
        self.open = None   # {"sizes", "frames", "at", "next"} of the unfinished message
        self.last = 0.0    # when its last part came

    def receiving(self, silent_s):
        """Whether a message is coming in parts; one whose parts stopped for silent_s is dropped."""
        if self.open is not None and time.monotonic() - self.last > silent_s:
            self.open = None
        return self.open is not None

    def take(self, frames):
        """The whole message, frames that are not a PART as they are, or None while parts are missing."""
        try:
            env = msgpack.unpackb(frames[0], raw=False)
        except Exception:
            return frames
        if not (isinstance(env, list) and len(env) == 5 and env[0] == "SWRM" and env[2] == PART and len(frames) >= 2):
            return frames
        self.last = time.monotonic()
        if env[3] == 0:
            self.open = None   # a part 0 starts over
        try:
            return self._take(env[3], frames)
        except WireError:
            self.open = None
            raise

    def _take(self, index, frames):
        if len(frames[1]) > PART_BYTES:
            raise WireError("too_large", f"PART {index}: frame 1 is over the limit")
        if self.open is None:
            if index != 0:
                raise WireError("out_of_order", f"PART {index} came with no part 0 before it")
            try:
                header = msgpack.unpackb(frames[1], raw=False)
            except Exception as e:
                raise WireError("malformed", f"PART 0: header is not msgpack: {e}")
            sizes = header.get("frames") if isinstance(header, dict) else None
            if not (isinstance(sizes, list) and 2 <= len(sizes) <= MAX_FRAMES and
                    all(isinstance(n, int) and n >= 0 for n in sizes)):
                raise WireError("malformed", "PART 0 must declare \"frames\": the size of each of the message's frames")
            if sum(sizes) > MAX_MESSAGE_BYTES:
                raise WireError("too_large", "PART 0 declares more than the message limit")
            self.open = {"sizes": sizes, "frames": [bytearray() for _ in sizes], "at": 0, "next": 0}
        elif index != self.open["next"]:
            raise WireError("out_of_order", f"PART {index} came where part {self.open['next']} was due")
        o = self.open
        sizes, got = o["sizes"], o["frames"]

        def skip_full():
            while o["at"] < len(sizes) and len(got[o["at"]]) == sizes[o["at"]]:
                o["at"] += 1

        total = 0
        for piece in frames[2:]:
            skip_full()
            total += len(piece)
            if not piece or total > PART_BYTES or o["at"] == len(sizes) or \
                    len(piece) > sizes[o["at"]] - len(got[o["at"]]):
                raise WireError("malformed", f"PART {index}: a piece is empty, over the limit or past the frames part 0 declared")
            got[o["at"]] += piece
        if total == 0:
            raise WireError("malformed", f"PART {index} carries no piece")
        o["next"] += 1
        skip_full()
        if o["at"] < len(sizes):
            return None
        self.open = None
        return [bytes(f) for f in got]


def f32(a):
    a = np.ascontiguousarray(np.asarray(a, np.float32))
    return ("f32", a.shape, a.tobytes())


def peek_id(frames):
    try:
        env = msgpack.unpackb(frames[0], raw=False)
        if isinstance(env, list) and len(env) == 5 and isinstance(env[3], int) and env[3] >= 0:
            return env[3]
    except Exception:
        pass
    return 0


def decode(frames):
    """frames -> (type, id, attempt, body, [(desc, payload)]); raises WireError."""
    if len(frames) < 2:
        raise WireError("truncated", f"a message needs an envelope and a body, got {len(frames)} frame(s)")
    try:
        env = msgpack.unpackb(frames[0], raw=False)
    except Exception as e:
        raise WireError("bad_magic", f"frame 0 is not a swarm envelope: {e}")
    if not (isinstance(env, list) and len(env) == 5 and env[0] == "SWRM"):
        raise WireError("bad_magic", "frame 0 is not a swarm envelope [\"SWRM\", version, type, id, attempt]")
    _, version, mtype, mid, attempt = env
    if version != VERSION and not (version == REFUSAL_VERSION and mtype == ERROR):
        raise WireError("bad_version", f"protocol version {version} is not supported: this peer speaks v{VERSION}")
    if not isinstance(mtype, int) or mtype not in KNOWN:
        raise WireError("unknown_type", f"unknown message type {mtype}")
    if not (isinstance(mid, int) and mid >= 0 and isinstance(attempt, int) and 0 <= attempt < 2 ** 32):
        raise WireError("malformed", "envelope id and attempt must be unsigned integers")
    n = len(frames) - 2
    if n > MAX_TENSORS.get(mtype, 0):
        raise WireError("malformed", f"type {mtype} carries at most {MAX_TENSORS.get(mtype, 0)} tensor(s), got {n}")
    try:
        body = msgpack.unpackb(frames[1], raw=False, strict_map_key=True)
    except Exception as e:
        raise WireError("malformed", f"body is not msgpack: {e}")
    if not isinstance(body, dict) or not all(isinstance(k, str) for k in body):
        raise WireError("malformed", "body is not a map with string keys")
    descs = body.pop("tensors", [])
    refs = body.pop("refs", [])
    body.pop("hold", None)
    if not isinstance(descs, list) or len(descs) != n:
        raise WireError("truncated", f"body describes {len(descs) if isinstance(descs, list) else '?'} tensor(s), {n} frame(s) follow")
    out = []
    for i, (d, p) in enumerate(zip(descs, frames[2:])):
        out.append((check_desc(d, i), bytes(p)))
        if len(p) != d["nbytes"]:
            raise WireError("truncated", f"tensor {i}: frame has {len(p)} bytes, description says {d['nbytes']}")
    for i, (d, p) in enumerate(out):
        if xxhash.xxh3_64_intdigest(p) != d["xxh64"]:
            raise WireError("checksum", f"tensor {i}: checksum mismatch")
    return mtype, mid, attempt, body, out, refs


def check_desc(d, i):
    if not isinstance(d, dict):
        raise WireError("malformed", f"tensor {i}: description is not a map")
    dtype, shape, codec = d.get("dtype"), d.get("shape"), d.get("codec")
    if dtype not in ("f32", "i32", "u16"):
        raise WireError("bad_tensor", f"tensor {i}: dtype must be one of f32, i32, u16")
    if not (isinstance(shape, list) and len(shape) <= 8 and all(isinstance(x, int) and 0 <= x < 2 ** 31 for x in shape)):
        raise WireError("bad_tensor", f"tensor {i}: shape entries must be non-negative integers")
    numel = int(np.prod(shape)) if shape else 1
    if dtype == "f32" and codec != "fp32":
        raise WireError("bad_tensor", f"tensor {i}: codec {codec!r}: this peer speaks only fp32")
    if dtype != "f32" and codec != "raw":
        raise WireError("bad_tensor", f"tensor {i}: integer tensors travel with codec 'raw'")
    if "zbytes" in d:
        raise WireError("bad_tensor", f"tensor {i}: zbytes given for codec {codec}, which is not zstd-packed")
    if not isinstance(d.get("nbytes"), int) or not isinstance(d.get("xxh64"), int):
        raise WireError("malformed", f"tensor {i}: nbytes and xxh64 must be unsigned integers")
    need = numel * (2 if dtype == "u16" else 4)
    if d["nbytes"] != need:
        raise WireError("bad_tensor", f"tensor {i}: {d['nbytes']} bytes declared but {numel} elements need {need}")
    return d


def array(desc, payload):
    dt = {"f32": np.float32, "i32": np.int32, "u16": np.uint16}[desc["dtype"]]
    return np.frombuffer(payload, dt).reshape(desc["shape"])


def field(body, key, kind, required=True, default=None):
    """A body field checked as protocol.md says: ints take no floats, strings no bin."""
    v = body.get(key)
    if v is None:
        if required:
            raise WireError("malformed", f"{key} is missing")
        return default
    ok = {"uint": isinstance(v, int) and not isinstance(v, bool) and v >= 0,
          "int": isinstance(v, int) and not isinstance(v, bool),
          "bool": isinstance(v, bool),
          "str": isinstance(v, str),
          "number": isinstance(v, (int, float)) and not isinstance(v, bool)}[kind]
    if not ok:
        raise WireError("malformed", f"{key} must be {kind}, got {v!r}")
    return v


# ---- the peer --------------------------------------------------------------------------------

class Peer:
    def __init__(self, args):
        self.args = args
        self.ctx = zmq.Context()
        self.route = ("py-" + secrets.token_hex(6)).encode()
        self.heartbeat_ms, self.liveness = 500, 3
        self.stage = None            # model.Stage once loaded
        self.job_id, self.stage_index = 0, -1
        self.stats = dict(forwards=0, backwards=0, cache_hits=0, recomputes=0, steps=0, errors=0)
        self.fetchers = {}
        self.connect()

    def connect(self):
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, self.route)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.args.router)
        self.parts = PartJoiner()
        self.router_parts = False   # until WELCOME says the router takes PARTs
        self.send(HELLO, 0, {"role": "stage", "version": VERSION, "name": self.args.name, "device": "cpu",
                             "device_name": "cpu", "precision": "fp32", "stage": self.args.stage, "prefer_stage": -1,
                             "pid": os.getpid(), "parts": True})
        self.last_heard = time.monotonic()

    def send(self, mtype, mid, body=None, tensors=(), attempt=0, version=VERSION):
        frames = encode(mtype, mid, body, tensors, attempt, version)
        for part in split_parts(frames) if self.router_parts else [frames]:
            self.sock.send_multipart(part)

    def error(self, mid, attempt, name, message, request_type=None, tensor=None):
        body = {"code": ERRC[name], "name": name, "message": message[:8000]}
        if request_type is not None:
            body["request_type"] = request_type
        if tensor is not None:
            body["tensor"] = tensor
        self.send(ERROR, mid, body, attempt=attempt, version=REFUSAL_VERSION if name == "bad_version" else VERSION)

    def heartbeat(self):
        self.send(HEARTBEAT, 0, {"stage": self.stage_index, "job_id": self.job_id, "ready": self.stage is not None,
                                 "queue": 0, "ms_per_unit": 0.0, "overflows": 0, "skipped_steps": 0, "loss_scale": 0.0,
                                 "receiving": self.parts.receiving(self.liveness * self.heartbeat_ms / 1000.0),
                                 **self.stats})

    def run(self):
        next_beat = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= next_beat:
                self.heartbeat()
                next_beat = now + self.heartbeat_ms / 1000.0
            if now - self.last_heard > self.liveness * self.heartbeat_ms / 1000.0 + 0.5:
                log("router silent; saying HELLO again")
                self.sock.close()
                self.connect()
            if not self.sock.poll(max(1, int((next_beat - time.monotonic()) * 1000))):
                continue
            frames = self.sock.recv_multipart()
            self.last_heard = time.monotonic()   # a PART too: the rest of its message is on the way
            try:
                frames = self.parts.take(frames)
            except WireError as e:
                self.stats["errors"] += 1
                log("dropped a message from the router that came in parts:", e)
                continue
            if frames is None:
                continue
            if self.handle(frames) == "bye":
                return

    def handle(self, frames):
        try:
            mtype, mid, attempt, body, tensors, refs = decode(frames)
        except WireError as e:
            self.stats["errors"] += 1
            self.error(peek_id(frames), 0, e.name, str(e))
            return None
        try:
            if mtype == WELCOME:
                self.heartbeat_ms = max(10, field(body, "heartbeat_ms", "int", False, self.heartbeat_ms))
                self.liveness = max(1, field(body, "liveness", "int", False, self.liveness))
                self.router_parts = body.get("parts") is True
                pid = body.get("peer_id")
                if pid is not None and not isinstance(pid, bytes):
                    raise WireError("malformed", "WELCOME.peer_id must be msgpack bin")
                log("registered as", pid)
            elif mtype == HEARTBEAT or mtype == RELEASE:
                pass
            elif mtype == BYE:
                log("router said goodbye:", body.get("reason", ""))
                return "bye"
            elif mtype == ERROR:
                log("router says:", body.get("message"))
                if body.get("code") == ERRC["out_of_order"] and body.get("request_type") == HEARTBEAT:
                    self.sock.close()
                    self.connect()
            elif mtype == CHAOS:
                self.error(mid, attempt, "malformed", "this peer takes no injected faults", CHAOS)
            elif mtype == FETCH:
                self.error(mid, attempt, "not_held", "this peer holds nothing for others", FETCH)
            else:
                if refs:
                    tensors = self.fetch(tensors, refs)
                reply = self.serve(mtype, body, tensors)
                if reply is not None:
                    rtype, rbody, rtensors = reply
                    self.send(rtype, mid, rbody, rtensors, attempt)
        except WireError as e:
            self.stats["errors"] += 1
            self.error(mid, attempt, e.name, str(e), mtype, e.tensor)
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
            self.stats["errors"] += 1
            self.error(mid, attempt, "bad_tensor", f"{type(e).__name__}: {e}", mtype)
        return None

    def fetch(self, inline, refs):
        """Tensors held by other peers: FETCH {key, part} to each holder, in slot order."""
        total = len(inline) + len(refs)
        slots = [None] * total
        for r in refs:
            slot = r["slot"]
            sock = self.fetchers.get(r["from"])
            if sock is None:
                sock = self.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(r["from"])
                self.fetchers[r["from"]] = sock
            sock.send_multipart(encode(FETCH, r["key"], {"key": r["key"], "part": r["part"]}))
            deadline = time.monotonic() + 30
            got = None
            while got is None:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    raise WireError("unreachable", f"no answer from {r['from']}", slot)
                rtype, rid, _, _, ts, _ = decode(sock.recv_multipart())
                if rid != r["key"]:
                    continue
                if rtype == ERROR:
                    raise WireError("not_held", f"{r['from']} no longer holds it", slot)
                got = ts[0]
            if got[0]["xxh64"] != r["desc"]["xxh64"] or got[0]["shape"] != r["desc"]["shape"]:
                raise WireError("bad_tensor", "the fetched tensor is not the one referenced", slot)
            slots[slot] = got
        it = iter(inline)
        return [s if s is not None else next(it) for s in slots]

    # ---- work ----

    def need(self, tensors, n):
        if len(tensors) != n:
            raise WireError("malformed", f"expected {n} tensor(s), got {len(tensors)}")

    def check_job(self, body):
        job = field(body, "job_id", "uint")
        if self.stage is None or job != self.job_id:
            raise WireError("out_of_order", f"job {job} is not loaded here")

    def stage_input(self, t):
        desc, payload = t
        a = array(desc, payload)
        S = self.stage
        if S.first:
            if desc["dtype"] == "f32" or a.ndim != 2:
                raise WireError("bad_tensor", "stage 0 takes integer tokens [B, T]", 0)
            if a.shape[1] > self.max_T:
                raise WireError("bad_tensor", f"{a.shape[1]} tokens over max_seq_len {self.max_T}", 0)
            if a.size and (a.min() < 0 or a.max() >= self.V):
                raise WireError("bad_tensor", f"a token out of [0, {self.V})", 0)
            return torch.from_numpy(a.astype(np.int64))
        if desc["dtype"] != "f32" or a.ndim != 3 or a.shape[2] != self.C:
            raise WireError("bad_tensor", f"a later stage takes activations [B, T, {self.C}]", 0)
        if not np.isfinite(a).all():
            raise WireError("bad_tensor", "non-finite values in the stage input", 0)
        return torch.from_numpy(a.copy())

    def targets(self, t, x):
        desc, payload = t
        a = array(desc, payload)
        if desc["dtype"] == "f32" or tuple(a.shape) != tuple(x.shape[:2]):
            raise WireError("bad_tensor", "targets are integers of the input's [B, T]", 1)
        if a.size and (a.min() < 0 or a.max() >= self.V):
            raise WireError("bad_tensor", f"a target out of [0, {self.V})", 1)
        return torch.from_numpy(a.astype(np.int64))

    def serve(self, mtype, body, tensors):
        if mtype == LOAD_STAGE:
            return self.load(body)
        self.check_job(body)
        S = self.stage
        if mtype in (FORWARD, FORWARD_LOSS, BACKWARD, EVAL):
            mb = field(body, "mb", "uint")
            t0 = time.monotonic()
            if mtype == FORWARD and S.last:
                raise WireError("out_of_order", "FORWARD does not go to the last stage (FORWARD_LOSS does)")
            if mtype == FORWARD_LOSS and not S.last:
                raise WireError("out_of_order", "FORWARD_LOSS goes to the last stage")
            if mtype == BACKWARD and S.last:
                raise WireError("out_of_order", "the last stage runs its backward inside FORWARD_LOSS")
            self.need(tensors, 2 if mtype in (FORWARD_LOSS, BACKWARD) or (mtype == EVAL and S.last) else 1)
            x = self.stage_input(tensors[0])
            res = {"mb": mb, "stage": self.stage_index}
            out = []
            if mtype in (FORWARD, EVAL):
                with torch.no_grad():
                    y = S.forward(x)
                    if S.last:
                        res["loss"] = M.Stage.loss(y, self.targets(tensors[1], x)).item()
                    else:
                        out.append(f32(y.numpy()))
                self.stats["forwards"] += 1
            elif mtype == FORWARD_LOSS:
                y_t = self.targets(tensors[1], x)
                if not S.first:
                    x.requires_grad_(True)
                loss = M.Stage.loss(S.forward(x), y_t)
                loss.backward(torch.tensor(float(x.shape[0])))    # (loss x B).backward()
                res.update(loss=loss.item(), samples=int(x.shape[0]))
                if not S.first:
                    out.append(f32(x.grad.numpy()))
                self.samples += int(x.shape[0])
                self.stats["backwards"] += 1
            else:
                g = array(*tensors[1])
                if tensors[1][0]["dtype"] != "f32" or not np.isfinite(g).all():
                    raise WireError("bad_tensor", "the output gradient is not finite fp32", 1)
                if not S.first:
                    x.requires_grad_(True)
                y = S.forward(x)
                if tuple(g.shape) != tuple(y.shape):
                    raise WireError("bad_tensor", "output gradient shape does not match the stage output", 1)
                y.backward(torch.from_numpy(g.copy()))
                res.update(cached=False, samples=int(x.shape[0]))
                if not S.first:
                    out.append(f32(x.grad.numpy()))
                self.samples += int(x.shape[0])
                self.stats["backwards"] += 1
                self.stats["recomputes"] += 1
            res["compute_ms"] = (time.monotonic() - t0) * 1000.0
            if self.spec["schedule"] == "async" and mtype in (FORWARD_LOSS, BACKWARD) and self.samples >= self.inner_batch:
                self.take_step()
            return RESULT, res, out
        if mtype == STEP:
            if not field(body, "skip", "bool", False, False):
                self.take_step()
            else:
                self.opt.zero_grad()
                self.samples = 0
            return RESULT, {"stage": self.stage_index, "steps": self.opt.t, "skipped": bool(body.get("skip", False))}, []
        if mtype == ROUND_BEGIN:
            return self.round_begin(body)
        if mtype == ROUND_REDUCE:
            return self.round_reduce(body, tensors)
        if mtype == ROUND_APPLY:
            return self.round_apply(body, tensors)
        if mtype == STATE_REQUEST:
            full = field(body, "full", "bool", False, False)
            out = [f32(self.theta_g), f32(self.momentum)]
            rep = {"stage": self.stage_index, "hash": M.state_hash(self.theta_g, self.momentum), "full": full}
            if full:
                m, v = self.opt.flat_moments()
                out += [f32(S.flat()), f32(m), f32(v)]
                rep.update(adam_step=self.opt.t, steps=self.stats["steps"], loss_scale=0.0, loss_scale_good_steps=0)
            return STATE_REPLY, rep, out
        if mtype == STATE_LOAD:
            if len(tensors) not in (2, 5):
                raise WireError("malformed", f"STATE_LOAD carries 2 or 5 tensors, got {len(tensors)}")
            vs = []
            for i, (d, p) in enumerate(tensors):
                a = array(d, p)
                if d["dtype"] != "f32" or a.shape != (self.P,) or not np.isfinite(a).all():
                    raise WireError("bad_tensor", f"state tensor {i} is not finite f32 [{self.P}]", i)
                vs.append(a.copy())
            self.theta_g, self.momentum = vs[0], vs[1]
            if len(vs) == 5:
                S.load_flat(vs[2])
                self.opt.load_moments(vs[3], vs[4], field(body, "adam_step", "uint"))
            else:
                S.load_flat(self.theta_g)
            self.opt.zero_grad()
            self.samples, self.sent = 0, {}
            return ROUND_DONE, {"stage": self.stage_index, "hash": M.state_hash(self.theta_g, self.momentum)}, []
        raise WireError("out_of_order", f"a stage server does not take message type {mtype}")

    def take_step(self):
        if self.samples == 0:
            return
        self.opt.step(self.samples)
        self.samples = 0
        self.stats["steps"] += 1

    def load(self, body):
        job = field(body, "job_id", "uint")
        stage = field(body, "stage", "int")
        spec = body.get("spec")
        if not isinstance(spec, dict):
            raise WireError("malformed", "LOAD_STAGE.spec must be a map")
        m = spec["model"]
        for key in ("activations", "gradients", "outer"):
            codec = spec.get("compression", {}).get(key, "fp32")
            if codec != "fp32":
                raise WireError("bad_tensor", f"compression.{key} is {codec!r}: this peer speaks only fp32")
        if m.get("precision", "auto") not in ("auto", "fp32"):
            raise WireError("bad_tensor", f"model.precision {m['precision']!r}: this peer computes in fp32 only")
        S = spec["partition"]["stages"]
        lps = spec["partition"].get("layers_per_stage") or [m["n_layer"] // S] * S
        if not 0 <= stage < S:
            raise WireError("bad_tensor", f"stage {stage} of a {S}-stage job")
        torch.manual_seed(0)
        self.stage = M.Stage(m, stage, S, lps, spec["seed"], self.args.deliberately_break)
        self.job_id, self.stage_index, self.spec = job, stage, spec
        self.C, self.V = m["d_model"], m["vocab_size"]
        self.max_T = m.get("max_seq_len") or m["seq_len"]
        self.inner_batch = spec["batch"].get("inner_batch") or spec["batch"]["batch_size"]
        self.opt = M.AdamW(self.stage.params, spec["optimizer"], spec["steps"])
        self.P = self.stage.numel()
        self.theta_g = self.stage.flat()
        self.momentum = np.zeros(self.P, np.float32)
        self.samples, self.sent = 0, {}
        log(f"loaded stage {stage} of job {job}: {self.P} parameters")
        return STAGE_READY, {"job_id": job, "stage": stage, "params": self.P, "fwd_ms": 1.0,
                             "hash": M.state_hash(self.theta_g, self.momentum), "precision": "fp32"}, []

    def round_ids(self, body):
        what = field(body, "what", "str", False, "delta")
        if what not in ("delta", "grad"):
            raise WireError("malformed", f"what must be delta or grad, got {what!r}")
        frag, frags = field(body, "fragment", "int", False, 0), field(body, "fragments", "int", False, 1)
        shards = field(body, "shards", "int", False, 1)
        n = self.P if what == "grad" else None
        lo, hi = (0, self.P) if what == "grad" else M.fragment_range(self.P, frags, frag)
        return what, frag, lo, hi, shards, n

    def round_begin(self, body):
        what, frag, lo, hi, shards, _ = self.round_ids(body)
        rep = {"round": field(body, "round", "uint"), "stage": self.stage_index, "what": what}
        if what == "grad":
            v = self.stage.flat_grads()
            rep["samples"] = self.samples
        else:
            theta = self.stage.flat()
            v = self.theta_g[lo:hi] - theta[lo:hi]
            self.sent[frag] = theta[lo:hi].copy()
            rep["samples"] = self.samples
        parts = [v[a:b] for a, b in (M.fragment_range(len(v), shards, j) for j in range(shards))]
        return ROUND_DELTA, rep, [f32(p) for p in parts]

    def round_reduce(self, body, tensors):
        what, frag, lo, hi, shards, _ = self.round_ids(body)
        weights = body.get("weights")
        if not isinstance(weights, list) or len(weights) != len(tensors) or not tensors:
            raise WireError("malformed", "ROUND_REDUCE carries one weight per tensor")
        n_all = self.P if what == "grad" else hi - lo
        a, b = M.fragment_range(n_all, shards, field(body, "shard", "int", False, 0))
        ds = []
        for i, (d, p) in enumerate(tensors):
            x = array(d, p)
            if d["dtype"] != "f32" or x.shape != (b - a,) or not np.isfinite(x).all():
                raise WireError("bad_tensor", f"tensor {i} is not finite f32 [{b - a}]", i)
            ds.append(x)
        if what == "delta" and not sum(weights) > 0:
            raise WireError("malformed", "ROUND_REDUCE weights sum to zero")
        left_out = M.outliers(ds, weights, grad_sums=what == "grad")
        far = M.outliers(ds, weights, grad_sums=what == "grad", factor=M.BLAME_FACTOR)
        s = M.reduce_delta(ds, weights, mean=what == "delta", left_out=left_out)
        reply = {"round": field(body, "round", "uint"), "stage": self.stage_index}
        if left_out:
            reply["outliers"] = left_out
        if far:
            reply["far"] = far
        return ROUND_REDUCED, reply, [f32(s)]

    def round_apply(self, body, tensors):
        what, frag, lo, hi, shards, _ = self.round_ids(body)
        self.need(tensors, shards)
        n_all = self.P if what == "grad" else hi - lo
        parts = []
        for j, (d, p) in enumerate(tensors):
            a, b = M.fragment_range(n_all, shards, j)
            x = array(d, p)
            if d["dtype"] != "f32" or x.shape != (b - a,) or not np.isfinite(x).all():
                raise WireError("bad_tensor", f"tensor {j} is not finite f32 [{b - a}]", j)
            parts.append(x)
        v = np.concatenate(parts).astype(np.float32)
        if what == "grad":
            self.stage.set_grads(v)
            samples = field(body, "samples", "uint", False, 0)
            if samples > 0:
                self.opt.step(samples)
            self.opt.zero_grad()
            self.samples = 0
            self.stats["steps"] += 1
            self.theta_g = self.stage.flat()
        else:
            d = self.spec["diloco"]
            tg, mom = self.theta_g[lo:hi].copy(), self.momentum[lo:hi].copy()
            M.outer_step(tg, mom, v, d["outer_lr"], d["outer_momentum"], d["nesterov"])
            self.theta_g[lo:hi], self.momentum[lo:hi] = tg, mom
            theta = self.stage.flat()
            sent = self.sent.pop(frag, None)
            progress = theta[lo:hi] - sent if sent is not None else np.zeros(hi - lo, np.float32)
            theta[lo:hi] = self.theta_g[lo:hi] + progress
            self.stage.load_flat(theta)
        return ROUND_DONE, {"round": field(body, "round", "uint"), "stage": self.stage_index,
                            "hash": M.state_hash(self.theta_g, self.momentum)}, []


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--router", required=True, help="router endpoint, tcp://HOST:PORT")
    ap.add_argument("--stage", type=int, default=-1, help="stage to serve, pinned (default: the router chooses)")
    ap.add_argument("--name", default=f"python-{os.getpid()}", help="name shown by `swarm peers`")
    ap.add_argument("--threads", type=int, default=1, help="torch compute threads")
    ap.add_argument("--deliberately-break", choices=["gelu"], default=None,
                    help="get one rule wrong on purpose (tests that the conformance kit notices)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    Peer(args).run()


if __name__ == "__main__":
    main()

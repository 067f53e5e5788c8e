"""docs/protocols.md's update rule is exact: its worked example follows from the text, and
a real server reproduces it.

The example's inputs and every number are read out of the document; the recomputation
below is written from the text alone (plain numpy float32, Python floats for the scalars)
and imports nothing of the server's update path (no ``rudra_async.kernels``, no
``rudra_async.lr``). Then the example's messages are replayed against a real server over
TCP, with the numpy and torch kernels (and cupy where a CUDA device is visible), and the
same replay with other settings checks the rest of the text (each policy, Nesterov, decay
by updates, no momentum).
"""

from __future__ import annotations

import asyncio
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from helpers import run_server

from rudra_async import checkpoint
from rudra_async.client import Client
from rudra_async.errors import ConfigError
from rudra_async.layout import Layout

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocols.md"
f32 = np.float32


# -- reading the document --------------------------------------------------------------------
def example_section(text: str) -> str:
    start = text.index("### Worked example")
    end = text.find("\n## ", start)
    return text[start : end if end != -1 else len(text)]


def tables(section: str) -> list[list[dict[str, str]]]:
    """Every markdown table of the section, as rows keyed by the header's cells."""
    found, lines = [], section.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-| ]+\|$", lines[i + 1]):
            header = cells(lines[i])
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(dict(zip(header, cells(lines[i]))))
                i += 1
            found.append(rows)
        else:
            i += 1
    return found


def cells(line: str) -> list[str]:
    return [c.strip().strip("`").strip() for c in line.strip().strip("|").split("|")]


def table_with(all_tables, column: str) -> list[dict[str, str]]:
    matches = [t for t in all_tables if t and column in t[0]]
    assert len(matches) == 1, f"expected one table with a {column!r} column, found {len(matches)}"
    return matches[0]


def number(text: str) -> float:
    """``3``, ``-0.375`` or a fraction ``2/3``."""
    return float(Fraction(text.strip()))


def numbers(text: str) -> list[float]:
    """``0, 1`` or ``[0.5, -1, 2]``."""
    return [number(x) for x in text.strip().strip("[]").split(",") if x.strip()]


#: the example's flags → (ServerConfig field, parser)
FLAGS = {
    "--protocol": ("protocol", str),
    "--n": ("n", int),
    "--lr": ("lr", float),
    "--momentum": ("momentum", float),
    "--weight-decay": ("weight_decay", float),
    "--nesterov": ("nesterov", lambda v: {"on": True, "off": False}[v]),
    "--lr-policy": ("lr_policy", str),
    "--mean-staleness-window": ("mean_staleness_window", int),
    "--warmup": ("warmup", int),
    "--lr-scale-ref-batch": ("lr_scale_ref_batch", int),
    "--samples-per-epoch": ("samples_per_epoch", int),
    "--lr-decay-at": ("lr_decay_at", lambda v: tuple(numbers(v))),
    "--lr-decay": ("lr_decay", float),
    "--lr-decay-unit": ("lr_decay_unit", str),
}


@dataclass
class Message:
    step: int
    learner: str
    kind: str  # HELLO | PUSH | BYE
    timestamp: int | None = None
    samples: int | None = None
    grad: np.ndarray | None = None
    reply: str = ""


@dataclass
class Example:
    settings: dict
    theta0: np.ndarray
    messages: list[Message]
    policy_rows: list[dict[str, str]]
    schedule_rows: list[dict[str, str]]
    vector_rows: list[dict[str, str]]


def read_example(text: str | None = None) -> Example:
    all_tables = tables(example_section(text if text is not None else DOC.read_text(encoding="utf-8")))
    settings, theta0 = {}, None
    for row in table_with(all_tables, "flag"):
        if row["flag"].startswith("--"):
            name, parse = FLAGS[row["flag"]]
            settings[name] = parse(row["value"])
        elif row["setting"] == "θ_0":
            theta0 = np.array(numbers(row["value"]), f32)
    assert theta0 is not None, "the settings table gives θ_0"
    messages = []
    for row in table_with(all_tables, "message"):
        m = Message(int(row["step"]), row["learner"], row["message"], reply=row["reply"])
        if m.kind == "PUSH":
            m.timestamp, m.samples = int(row["timestamp"]), int(row["samples"])
            m.grad = np.array(numbers(row["gradient"]), np.dtype(row["dtype"]))
        messages.append(m)
    return Example(
        settings,
        theta0,
        messages,
        table_with(all_tables, "f_l"),
        table_with(all_tables, "η_t"),
        table_with(all_tables, "θ_{t+1}"),
    )


# -- the text's update rule, implemented from docs/protocols.md alone -------------------------
@dataclass
class Update:
    t: int
    pushes: list[int]  # message steps
    sigmas: list[int]
    window: list[int]
    mean: float | None
    f: list[float]
    s: list[float]
    P: int
    e: float | None
    k: int
    decay_k: float
    w: float
    S: int
    r: float
    eta: float
    g: np.ndarray
    d: np.ndarray
    v: np.ndarray
    theta: np.ndarray  # θ_{t+1}


@dataclass
class Run:
    updates: list[Update] = field(default_factory=list)
    replies: dict[int, str] = field(default_factory=dict)  # message step → expected reply


def policy_factor(name: str, sigma: int, window: list[int]) -> float:
    if name == "constant":
        return 1.0
    if name == "staleness":
        return 1.0 / sigma if sigma > 0 else 1.0
    if name == "staleness-plus-one":
        return 1.0 / (sigma + 1)
    if name == "mean-staleness":
        return 1.0 / max(1.0, sum(window) / len(window))
    raise AssertionError(f"the text defines no policy {name!r}")


def replay_text(ex: Example, settings: dict) -> Run:
    """What the text says happens: softsync batching, then the steps of "The update"."""
    cfg = {
        "lr": 0.03,
        "momentum": 0.9,
        "weight_decay": 0.0,
        "nesterov": False,
        "lr_policy": "constant",
        "mean_staleness_window": 0,
        "lr_decay_at": (),
        "lr_decay": 0.1,
        "lr_decay_unit": "updates",
        "warmup": 0,
        "lr_scale_ref_batch": None,
        "samples_per_epoch": None,
        **settings,
    }
    assert cfg["protocol"] == "softsync", "this replay knows softsync's batching only"
    n = cfg["n"]
    theta = ex.theta0.copy()
    v = np.zeros_like(theta)
    run, members, held, observed = Run(), set(), [], []
    staleness: dict[int, int] = {}  # message step → σ, once its gradient is applied
    t = P = 0

    def apply(batch: list[Message]) -> None:
        nonlocal t, P, theta, v
        c = len(batch)
        sigmas = [t - m.timestamp for m in batch]
        observed.extend(sigmas)  # step 1: observed, all of them, before any factor
        W = cfg["mean_staleness_window"]
        window = observed[-W:] if W else list(observed)
        f = [policy_factor(cfg["lr_policy"], s, window) for s in sigmas]
        s = [fl / c for fl in f]
        S = sum(m.samples for m in batch)
        e = P / cfg["samples_per_epoch"] if cfg["samples_per_epoch"] else None
        position = t if cfg["lr_decay_unit"] == "updates" else e
        k = sum(1 for M in cfg["lr_decay_at"] if position >= M)
        decay_k = cfg["lr_decay"] ** k
        w = (t + 1) / cfg["warmup"] if t < cfg["warmup"] else 1.0
        R = cfg["lr_scale_ref_batch"]
        r = S / R if R and S > 0 else 1.0
        eta = cfg["lr"] * decay_k * w * r
        # the vectors, float32, one rounding per operation, in the order of "Arithmetic"
        g = f32(s[0]) * batch[0].grad.astype(f32)
        for sl, m in zip(s[1:], batch[1:]):
            g = g + f32(sl) * m.grad.astype(f32)
        d = g + theta * f32(cfg["weight_decay"]) if cfg["weight_decay"] else g
        if cfg["momentum"]:
            v = v * f32(cfg["momentum"]) + d
            step = d + v * f32(cfg["momentum"]) if cfg["nesterov"] else v
        else:
            step = d
        theta = theta + step * f32(-eta)
        run.updates.append(
            Update(
                t,
                [m.step for m in batch],
                sigmas,
                window,
                sum(window) / len(window) if cfg["lr_policy"] == "mean-staleness" else None,
                f,
                s,
                P,
                e,
                k,
                decay_k,
                w,
                S,
                r,
                eta,
                g,
                d,
                v.copy(),
                theta.copy(),
            )
        )
        staleness.update((m.step, sigma) for m, sigma in zip(batch, sigmas))
        t += 1
        P += S

    def drain() -> None:
        c = max(1, len(members) // n)
        while len(held) >= c:
            batch, held[:] = held[:c], held[c:]
            apply(batch)

    for m in ex.messages:
        if m.kind == "HELLO":
            members.add(m.learner)
            run.replies[m.step] = f"WELCOME, clock {t}"
            drain()
        elif m.kind == "BYE":
            members.discard(m.learner)
            run.replies[m.step] = "BYE"
            drain()
        else:
            assert m.kind == "PUSH", m.kind
            held.append(m)
            drain()  # the reply comes after: applied if its batch was, else pending
            sigma = staleness.get(m.step)
            run.replies[m.step] = "ACK pending" if sigma is None else f"ACK applied, staleness {sigma}"
    return run


# -- the document's numbers follow from its text ---------------------------------------------
def close(doc_value: str, value: float) -> bool:
    return math.isclose(number(doc_value), value, rel_tol=1e-12, abs_tol=1e-15)


def same_f32(doc_value: str, value: np.ndarray) -> bool:
    return np.array_equal(np.array(numbers(doc_value), f32), value)


def check_document(ex: Example) -> None:
    run = replay_text(ex, ex.settings)
    for m in ex.messages:
        assert m.reply == run.replies[m.step], (
            f"message {m.step}: the doc says {m.reply!r}, the text gives {run.replies[m.step]!r}"
        )
    assert len(ex.policy_rows) == len(ex.schedule_rows) == len(ex.vector_rows) == len(run.updates)
    for u, p, s, vec in zip(run.updates, ex.policy_rows, ex.schedule_rows, ex.vector_rows):
        where = f"update t = {u.t}"
        assert int(p["t"]) == int(s["t"]) == int(vec["t"]) == u.t, where
        assert int(p["c"]) == len(u.pushes) and [int(x) for x in numbers(p["pushes"])] == u.pushes, where
        assert numbers(p["σ_l"]) == u.sigmas and numbers(p["window"]) == u.window, where
        assert u.mean is not None and close(p["⟨σ⟩"], u.mean), where
        for column, values in (("f_l", u.f), ("s_l", u.s)):
            doc = numbers(p[column])
            assert len(doc) == len(values) and all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(doc, values)), (
                f"{where}: {column} is {values}, the doc says {p[column]}"
            )
        assert int(s["P"]) == u.P and int(s["S"]) == u.S and int(s["k"]) == u.k, where
        epoch = next(key for key in s if key.startswith("e ="))
        assert u.e is not None and close(s[epoch], u.e), where
        for column, value in (("decay^k", u.decay_k), ("w_t", u.w), ("r_t", u.r), ("η_t", u.eta)):
            assert close(s[column], value), f"{where}: {column} is {value!r}, the doc says {s[column]}"
        for column, value in (("g", u.g), ("d = g + ω·θ_t", u.d), ("v", u.v), ("θ_{t+1}", u.theta)):
            assert same_f32(vec[column], value), f"{where}: {column} is {value.tolist()}, the doc says {vec[column]}"


def test_the_documented_numbers_follow_from_the_text():
    check_document(read_example())


def test_the_documented_misreading_differs():
    """The doc contrasts its rule with SGD run at learning rate η_t·f (the gradient unscaled)."""
    text = DOC.read_text(encoding="utf-8")
    claimed = re.search(r"would give\s+θ_3 = (\[[^]]*\])", example_section(text))
    assert claimed, "the example states what the misreading gives"
    ex = read_example(text)
    run = replay_text(ex, ex.settings)
    before, last = run.updates[-2], run.updates[-1]
    (push,) = [m for m in ex.messages if m.step in last.pushes]
    cfg = ex.settings
    v = before.v * f32(cfg["momentum"]) + (push.grad + before.theta * f32(cfg["weight_decay"]))
    wrong = before.theta + v * f32(-(last.eta * last.f[0]))
    assert same_f32(claimed.group(1), wrong)
    assert not np.allclose(wrong, last.theta, rtol=1e-3)


def test_a_wrong_number_in_the_document_is_caught():
    text = DOC.read_text(encoding="utf-8")
    for good, bad in (("| 0.025 |", "| 0.05 |"), ("0.32734337]", "0.3273434]")):  # η_2; θ_3 one float32 ulp off
        assert text.count(good) == 1
        with pytest.raises(AssertionError):
            check_document(read_example(text.replace(good, bad)))


# -- a real server computes the same --------------------------------------------------------
LAYOUT = Layout.from_shapes([("w", (3,))])


async def replay_on_server(ex: Example, settings: dict, kernel: str, tmp_path: Path):
    """Send the example's messages; returns (replies by step, θ after each update, the
    checkpoint's momentum at the end)."""
    replies, thetas = {}, []
    try:
        server = run_server(kernel=kernel, **settings)
        ps = await server.__aenter__()
    except ConfigError as exc:
        pytest.skip(str(exc))
    try:
        url = ps.addresses[0]
        clients: dict[str, Client] = {}
        for m in ex.messages:
            if m.kind == "HELLO":
                initial = ex.theta0 if not clients else None
                clients[m.learner] = c = await Client.connect(url, LAYOUT, initial, name=m.learner)
                replies[m.step] = f"WELCOME, clock {c.clock}"
            elif m.kind == "BYE":
                c = clients.pop(m.learner)
                await c.close()
                replies[m.step] = "BYE"
                for _ in range(200):  # the server notices the departure right after its BYE reply
                    if not ps.stats()["learners"][str(c.learner_id)]["connected"]:
                        break
                    await asyncio.sleep(0.005)
            else:
                before = ps.clock
                ack = await clients[m.learner].push(m.grad, m.timestamp, samples=m.samples)
                replies[m.step] = f"ACK {ack.status}" + (
                    f", staleness {ack.staleness}" if ack.staleness is not None else ""
                )
                for clock in range(before + 1, ps.clock + 1):
                    weights = await next(iter(clients.values())).pull()
                    assert weights.timestamp == clock == len(thetas) + 1
                    thetas.append(weights.array.copy())
        path = tmp_path / f"{kernel}.ckpt"
        await ps.checkpoint(str(path))
        for c in clients.values():
            await c.close()
    finally:
        await server.__aexit__(None, None, None)
    return replies, thetas, checkpoint.load(path).momentum


KERNELS = [  # cupy is skipped without a CUDA device
    "numpy",
    pytest.param("torch", marks=pytest.mark.torch),
    pytest.param("cupy", marks=pytest.mark.gpu),
]


def assert_weights(kernel: str, got: np.ndarray, expected: np.ndarray, what: str) -> None:
    if kernel == "numpy":  # the reference order of operations: bit for bit
        assert np.array_equal(got, expected), f"{what}: {got.tolist()} != {expected.tolist()}"
    else:  # torch, cupy: fused multiply-adds may change the last bits
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7, err_msg=what)


@pytest.mark.parametrize("kernel", KERNELS)
async def test_a_server_reproduces_the_worked_example(kernel, tmp_path):
    ex = read_example()
    replies, thetas, momentum = await asyncio.wait_for(replay_on_server(ex, ex.settings, kernel, tmp_path), 30)
    assert replies == {m.step: m.reply for m in ex.messages}
    assert len(thetas) == len(ex.vector_rows)
    for theta, row in zip(thetas, ex.vector_rows):
        assert_weights(kernel, theta, np.array(numbers(row["θ_{t+1}"]), f32), f"θ after update {row['t']}")
    # the checkpoint's second segment is v itself (torch's momentum buffer), not η·v
    assert_weights(kernel, momentum, np.array(numbers(ex.vector_rows[-1]["v"]), f32), "checkpointed momentum")


VARIANTS = {
    "nesterov": {"nesterov": True},
    "constant": {"lr_policy": "constant"},
    "staleness": {"lr_policy": "staleness"},
    "staleness-plus-one": {"lr_policy": "staleness-plus-one"},
    "mean-staleness-whole-run": {"mean_staleness_window": 0},
    "decay-by-updates": {"lr_decay_unit": "updates", "lr_decay_at": (2,)},
    "no-momentum-decay-warmup-scaling": {
        "momentum": 0.0,
        "weight_decay": 0.0,
        "warmup": 0,
        "lr_scale_ref_batch": None,
        "lr_decay_at": (),
    },
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("variant", list(VARIANTS))
async def test_a_server_follows_the_text_with_other_settings(variant, kernel, tmp_path):
    ex = read_example()
    settings = {**ex.settings, **VARIANTS[variant]}
    expected = replay_text(ex, settings)
    replies, thetas, momentum = await asyncio.wait_for(replay_on_server(ex, settings, kernel, tmp_path), 30)
    assert replies == expected.replies
    assert len(thetas) == len(expected.updates)
    for theta, u in zip(thetas, expected.updates):
        assert_weights(kernel, theta, u.theta, f"{variant}: θ after update {u.t}")
    assert_weights(kernel, momentum, expected.updates[-1].v, f"{variant}: checkpointed momentum")


if __name__ == "__main__":  # print the example's tables as the text computes them (to update the doc)
    example = read_example()
    fmt = lambda a: "[" + ", ".join(np.format_float_positional(x, unique=True, trim="-") for x in a) + "]"
    for u in replay_text(example, example.settings).updates:
        print(u.t, u.pushes, u.sigmas, u.window, u.mean, u.f, u.s, "|", u.P, u.e, u.k, u.decay_k, u.w, u.S, u.r, u.eta)
        print("   ", " | ".join(fmt(a) for a in (u.g, u.d, u.v, u.theta)))

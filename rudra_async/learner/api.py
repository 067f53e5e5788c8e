"""Train your own PyTorch model on a rudra-async server, as with Horovod's or BytePS's
``DistributedOptimizer``: build the model, loss and data as usual, then::

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = DistributedOptimizer(model, "tcp://server:7000", optimizer=optimizer)
    loader = DataLoader(train_set, batch_size=32, sampler=ShardSampler(train_set))  # this learner's part
    for x, y in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if not optimizer.step(loss=loss, samples=len(x)):  # push the gradient, pull the next weights
            break                                          # the server's run is over
    optimizer.close()

The server applies the update (docs/protocols.md): the optimizer given here declares the
parameter groups (lr, weight decay) and is checked against the server's momentum and
nesterov; its own ``step()`` is never called. The wrapper *is* a ``torch.optim.Optimizer``
over the same parameter groups (the same dicts as the optimizer given): a learning-rate
scheduler made on either changes ``param_groups[i]["lr"]``, and ``step()`` sends the new
rates to the server with its next gradient (a push's ``lr``); ``state_dict()`` and
``load_state_dict()`` are torch's, so the usual checkpoint of model and optimizer works.

**What is sent.** Every parameter with ``requires_grad`` is trained on the server, in the
order of the optimizer's parameter groups (or of ``model.named_parameters()`` without an
optimizer). Frozen parameters (``requires_grad=False``) and buffers (BatchNorm's running
statistics, ...) are the model's *state*: the first learner's values become the run's and
every learner starts from the run's (a learner whose frozen parameters differ is told and
takes the run's); each learner's buffers change with its own forward passes, and it reports
them to the server every ``state_every`` steps and when it closes. The server combines the
reports (docs/protocols.md#the-models-state) and keeps the result in its checkpoint, so
``rudra-async evaluate --model`` reproduces the trained model whole.

**Overlap** (the paper's "adv*"): with ``overlap=True`` the push and pull of step t run in
a background thread while step t+1 computes on the weights already at hand; each gradient is
then one more update stale. The weights are double-buffered and the exchange keeps the
gradient tensors it sends (the parameters' ``.grad`` is None after such a step; zero for a
model on a device), so nothing is copied. A gradient the server refused is raised by the
next step(), once.

A gradient the server refuses as an outlier (``gradient_outlier``: its max |g| far above
the run's recent ones, as one small mini-batch's spike can be) is lost and the learner goes
on from the server's weights (counted in :attr:`refused`, with a warning); 20 such refusals
in a row raise a LearnerError (a diverging model). Every other refusal is raised.
"""

from __future__ import annotations

import concurrent.futures
import logging
import operator
import os
import ssl
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import numpy as np
import torch
from torch import nn

from .. import transports
from ..client import Gradient, Stamp, SyncClient, Weights, went_back
from ..errors import LearnerError, RemoteError, TransportError, quoted
from ..sync import overlap_breaks
from ..wire import DEFAULT_TIMEOUT
from . import sampler
from .binding import FlatParameters, sparse_gradients
from .local_group import GroupClient, LocalGroup
from .state import ModelState

log = logging.getLogger(__name__)
T = TypeVar("T")


def trainable_parameters(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[list[tuple[str, nn.Parameter]], list[list[Any]] | None]:
    """The parameters the server trains, in order, and the optimizer's groups in HELLO's form
    (``[[tensors, lr, weight_decay], ...]``; None without an optimizer). An optimizer the
    server cannot run whatever its settings is a :class:`LearnerError` (before connecting)."""
    names = {id(p): n for n, p in model.named_parameters()}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if optimizer is None:
        return trainable, None
    if not isinstance(optimizer, torch.optim.SGD):
        raise LearnerError(f"the server applies SGD; {type(optimizer).__name__} cannot be run there")
    ordered: list[tuple[str, nn.Parameter]] = []
    groups = []
    for group in optimizer.param_groups:
        if group.get("dampening", 0) != 0:
            raise LearnerError("the server's SGD has no dampening; build the optimizer with dampening=0")
        if group.get("maximize", False):
            raise LearnerError("the server's SGD minimizes the loss; build the optimizer with maximize=False")
        params = [p for p in group["params"] if p.requires_grad]
        unknown = [p for p in params if id(p) not in names]
        if unknown:
            raise LearnerError("the optimizer holds parameters that are not the model's")
        if params:
            ordered += [(names[id(p)], p) for p in params]
            base = group.get("initial_lr", group["lr"])  # a scheduler's base rate: what the run started from
            groups.append([len(params), float(base), float(group["weight_decay"])])
    left_out = [n for n, p in trainable if id(p) not in {id(q) for _, q in ordered}]
    if left_out:
        raise LearnerError(f"parameter(s) {', '.join(left_out)} require grad but are in no group of the optimizer")
    return ordered, groups


#: the server's refusals of one gradient that a learner goes on after (from the server's
#: weights; the gradient is lost): an outlier may be one mini-batch's spike
SKIPPED_REFUSALS = ("gradient_outlier",)
#: ... unless this many come in a row (a diverging model)
MAX_REFUSED_IN_A_ROW = 20


def refuse_sparse(model: nn.Module, named: Sequence[tuple[str, nn.Parameter]]) -> None:
    """Raise :class:`LearnerError` for a trained parameter of a layer that makes sparse
    gradients (``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True``)."""
    names = {id(p): n for n, p in named}
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse and id(module.weight) in names:
            raise sparse_gradients(names[id(module.weight)])


def check_optimizer(optimizer: torch.optim.Optimizer | None, welcome: dict[str, Any]) -> None:
    """The settings the server applies to every group (its WELCOME says which) must be the optimizer's."""
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        for key, theirs in (("momentum", welcome.get("momentum")), ("nesterov", welcome.get("nesterov"))):
            if theirs is not None and group[key] != theirs:
                flag = f"--{key} {group[key]}" if key == "momentum" else ("--" if group[key] else "no --") + key
                raise LearnerError(
                    f"the optimizer's {key} is {group[key]}, the server's is {theirs} "
                    f"(start the server with {flag}, or build the optimizer with {key}={theirs})"
                )


def as_samples(samples: Any) -> int:
    """``samples`` as an int >= 0 (a numpy integer or a one-value integer tensor too), else
    :class:`LearnerError`."""
    try:
        count = operator.index(samples)
    except TypeError:
        raise LearnerError(f"samples must be an integer, got {type(samples).__name__} {quoted(samples)}") from None
    if count < 0:
        raise LearnerError(f"samples must be >= 0, got {count}")
    return count


def as_loss(loss: Any) -> float | None:
    """``loss`` as a float (None stays None): a number or a one-value tensor, else :class:`LearnerError`."""
    if loss is None:
        return None
    try:
        return float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
    except (TypeError, ValueError, RuntimeError):
        shown = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else quoted(loss)
        raise LearnerError(f"loss must be a number or a one-value tensor, got {shown}") from None


#: the settings of a parameter group that the server fixes when the run starts
FIXED = ("momentum", "nesterov", "weight_decay", "dampening")


def share_of_cores(learners: int) -> int:
    """The cores this process may use divided among ``learners`` learner processes (at least 1)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, learners))


def set_threads(threads: int | Literal["auto"] | None, learners: int, url: str) -> None:
    """torch's CPU threads for a learner: ``threads`` if a number; None: as they are;
    ``"auto"``: where the server is on this host (a loopback or shm address) and nobody set
    ``OMP_NUM_THREADS``, :func:`share_of_cores` among the run's λ learners (never more than
    torch has now): learners sharing a host must not each take every core."""
    if threads is None:
        return
    if threads != "auto":
        torch.set_num_threads(max(1, int(threads)))
        return
    if "OMP_NUM_THREADS" in os.environ or not all(transports.is_loopback(u) for u in url.split(",")):
        return
    share = share_of_cores(learners)
    if share < torch.get_num_threads():
        log.info("%d learners share this host: %d torch thread(s) each (threads= sets another number)", learners, share)
        torch.set_num_threads(share)


class DistributedOptimizer(torch.optim.Optimizer):
    """One learner: ``model`` trained on the server(s) at ``server``.

    ``server``: an address (``tcp://host:port``, ``shm://name``, ...), or every shard's, as a
    list or comma-separated, in shard order. ``optimizer``: a ``torch.optim.SGD`` whose
    parameter groups (lr, weight decay) the server uses. ``reconnect``: seconds to keep
    trying to reach a server that is not up yet or was lost (0: raise at once).
    ``overlap``: push/pull in the background (see the module docstring). ``secret``: the
    server's shared secret (default: ``RUDRA_ASYNC_SECRET``); ``tls``: an ``ssl.SSLContext``
    for a TLS server (:func:`rudra_async.security.client_tls`). ``index``: the learner index
    to ask the server for (default: the lowest free one). ``threads``: see :func:`set_threads`.
    ``state_every``: report the model's buffers every this many steps (and at :meth:`close`).
    ``group``: this learner is a member of a learner group
    (:class:`~rudra_async.learner.local_group.LocalGroup`: the group's gradients are added on
    this host and its leader alone talks to the server; not with ``overlap``).

    After connecting, :attr:`index` and :attr:`learners` (λ) say which part of the data is
    this learner's (:class:`~rudra_async.learner.sampler.ShardSampler` takes it). Errors are
    the client's (``RemoteError``, ``TransportError``, ...) and
    :class:`~rudra_async.errors.LearnerError`.
    """

    def __init__(
        self,
        model: nn.Module,
        server: str | Sequence[str],
        optimizer: torch.optim.Optimizer | None = None,
        *,
        name: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        reconnect: float = 0.0,
        overlap: bool = False,
        secret: bytes | str | None = None,
        tls: ssl.SSLContext | None = None,
        index: int | None = None,
        threads: int | Literal["auto"] | None = "auto",
        state_every: int = 50,
        group: LocalGroup | None = None,
    ) -> None:
        if group is not None and overlap:
            raise LearnerError("a learner group cannot overlap (overlap=True): its members exchange in step")
        named, groups = trainable_parameters(model, optimizer)
        refuse_sparse(model, named)
        self.model = model
        self.flat = FlatParameters(named)
        self.model_state = ModelState(model, [p for _, p in named])
        self.reconnect = reconnect
        self.state_every = max(1, state_every)
        self.steps = 0  # step() calls
        self.pushes = 0  # gradients the server accepted (not refused because the run was over)
        self.reconnects = 0
        self.refused = 0  # gradients the server refused as outliers (the learner went on)
        self._refused_in_a_row = 0
        self.stopped = False
        self._said_over = False  # the warning that step() no longer trains was given
        self._inner = optimizer
        self._url = server if isinstance(server, str) else ",".join(server)
        # All client calls run in one thread: this one, or the background one when overlapping.
        self._worker = concurrent.futures.ThreadPoolExecutor(1, "rudra-exchange") if overlap else None
        self._pending: concurrent.futures.Future[Weights | None] | None = None
        self._reconnects_sent = 0  # self.reconnects when the pending exchange was started
        try:
            cpu_overlap = overlap and self.flat.on_cpu
            self._spare = torch.empty_like(self.flat.weights) if cpu_overlap else None  # the other weights buffer

            def connect() -> SyncClient:
                return SyncClient(
                    self._url,
                    self.flat.layout,
                    self.flat.host_weights,
                    wait=reconnect,
                    name=name,
                    timeout=timeout,
                    groups=groups,
                    secret=secret,
                    tls=tls,
                    index=index,
                    state=self.model_state.layout if self.model_state else None,
                )

            def client() -> SyncClient | GroupClient:
                return connect() if group is None else GroupClient(group, connect, self.flat.layout)

            self.client = self._call(client)
            welcome = self.client.welcome
            check_optimizer(optimizer, welcome)
            if overlap and (why := overlap_breaks(welcome)) is not None:
                raise LearnerError(f"overlap=True cannot train on this server: {why}")
            set_threads(threads, self.client.learners, self._url)
            self._take_run_state()
            self.client.set_weights_buffer(self.flat.host_weights)  # pulled weights land in the model (CPU)
            self._arrived(self._call(self.client.pull))
        except BaseException:
            self.close()
            raise
        params = [p for _, p in named]
        if optimizer is not None:
            super().__init__(optimizer.param_groups, optimizer.defaults)  # the very same group dicts
        else:
            super().__init__(_server_groups(params, welcome), {})
        self._fixed = [{k: g.get(k) for k in FIXED} for g in self.param_groups]
        self._sent_lr: list[float] | None = [float(g[1]) for g in groups] if groups else list(welcome["lr"])
        sampler.register(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, keeping the parameter-group dicts (shared with the optimizer given and the
        schedulers made on either): their values are replaced by the loaded ones."""
        groups = self.param_groups
        super().load_state_dict(state_dict)
        for mine, loaded in zip(groups, self.param_groups):
            mine.update({k: v for k, v in loaded.items() if k != "params"})
        self.param_groups = groups

    # -- what the learner is -------------------------------------------------------------------
    @property
    def index(self) -> int:
        """This learner's index among the run's learners (its part of the data)."""
        return self.client.index

    @property
    def learners(self) -> int:
        """λ, the run's learners (as the server last said): how many parts the data has."""
        return self.client.learners

    @property
    def _group_ended(self) -> bool:
        """Whether this learner's group ended (a member stopped): its steps no longer reach the server."""
        return isinstance(self.client, GroupClient) and self.client.ended

    @property
    def learner_id(self) -> int:
        return self.client.learner_id

    # -- the training step ----------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients for the next backward (on the CPU ``.grad = None``, as torch's
        ``zero_grad`` does; on a device, the bound flat gradient is zeroed)."""
        self.flat.zero_grad()

    def step(  # type: ignore[override]
        self, loss: float | torch.Tensor | Callable[[], Any] | None = None, samples: int = 0
    ) -> bool:
        """Push the gradient of the last backward pass, stamped with the weights it was
        computed on, and bring the next weights into the model. ``samples``: the mini-batch
        size, an integer >= 0 (the server's linear scaling rule and epoch schedule use it);
        ``loss``: a number or a one-value tensor, reported for the server's loss curve (or a
        closure that computes it, as torch's ``step(closure)``). Learning rates changed in
        :attr:`param_groups` (by a scheduler) go to the server with this gradient.

        Returns False once the server's run is over (from the step whose reply said so on:
        later calls train nothing, and the first of them logs a warning). With overlap, a
        gradient the server refused is raised (once) by the next step(), which then sends
        nothing."""
        if callable(loss):
            with torch.enable_grad():
                loss = loss()
        count, value = as_samples(samples), as_loss(loss)
        if self.stopped:
            if not self._said_over:
                log.warning(
                    "%s: step() no longer trains; leave the training loop when step() returns False (a loader with "
                    "rt.ShardSampler ends by itself)",
                    "this learner's group has ended (a member stopped)"
                    if self._group_ended
                    else "the server's run is over (it reached its --max-updates)",
                )
                self._said_over = True
            return False
        if self._inner is not None:  # what torch's own step() tells a scheduler made on that optimizer
            self._inner._opt_called = True  # type: ignore[attr-defined]
        lr = self._new_rates()
        stamp, step = self.timestamp, self.steps
        self.steps += 1
        if self._worker is None:
            self._arrived(self._exchange(self.flat.gradients(), stamp, step, count, value, lr))
        else:
            self._overlapped_step(stamp, step, count, value, lr)
        if self.steps % self.state_every == 0 and not self.stopped:
            self._report_buffers()
        return not self.stopped

    def _new_rates(self) -> list[float] | None:
        """The groups' learning rates when they changed since they last went to the server
        (None otherwise); a change of what the server fixes at the start is a LearnerError."""
        for i, (group, fixed) in enumerate(zip(self.param_groups, self._fixed)):
            for key, value in fixed.items():
                if group.get(key) != value:
                    raise LearnerError(
                        f"param_groups[{i}][{key!r}] changed from {value} to {group.get(key)}: the server fixes it "
                        "when the run starts (only 'lr' may change, e.g. by a scheduler)"
                    )
        rates = [float(group["lr"]) for group in self.param_groups]
        if rates == self._sent_lr:
            return None
        if not all(r > 0 and r < float("inf") for r in rates):
            raise LearnerError(f"learning rates must be finite and > 0, got {rates}")
        self._sent_lr = rates
        return rates

    def _overlapped_step(
        self, stamp: Stamp, step: int, samples: int, loss: float | None, lr: list[float] | None
    ) -> None:
        """Wait for the previous exchange, give the model the weights it brought, and start this
        step's exchange with the gradient just computed. On the CPU the model and the exchange
        use alternate weights buffers and the exchange keeps the gradient tensors, which the
        model lets go of (nothing is copied); on a device the exchange uses the host staging."""
        assert self._worker is not None
        first = self._pending is None
        received = None if first else self._last_exchange()  # a refusal is raised here, once
        # The previous exchange is over: the staging buffers are free. The gradient is taken before
        # new weights reach the model: on a device, taking it waits for the backward that reads them.
        grads = self.flat.gradients()
        if not first:
            self._take(received)
            self._pending = None  # only now: an interruption before leaves its weights to take again
        self.flat.release_gradients()  # the next backward cannot write into what is being sent
        if first:
            if self._spare is not None:  # the model goes on computing on the weights at hand
                self._spare.copy_(self.flat.weights)
                self._swap()
        elif self.stopped or self.reconnects != self._reconnects_sent:
            # Nothing more is sent: the run is over, or that exchange reached a new server
            # (restarted, or resumed at an earlier clock): this gradient was computed on the lost
            # server's weights and is lost with it, as the one in flight was; the model goes on
            # from the new weights, as on the first step.
            return
        receive_into = self.flat.host_weights if self._spare is None else self._spare.numpy()
        self._reconnects_sent = self.reconnects
        self._pending = self._worker.submit(self._send_from, grads, receive_into, stamp, step, samples, loss, lr)

    def _last_exchange(self) -> Weights | None:
        """Wait for the exchange in flight: what it brought (the caller forgets it once taken),
        or its error, raised once (then it is forgotten). An interrupted wait (Ctrl-C) leaves it
        pending, to be waited for again."""
        pending = self._pending
        assert pending is not None
        try:
            return pending.result()
        except Exception:
            self._pending = None
            raise

    def _swap(self) -> None:
        """Overlap on the CPU: the model moves onto the spare weights buffer, and the one it
        leaves becomes the spare (on a device, weights always arrive in the host staging)."""
        if self._spare is not None:
            self._spare, weights = self.flat.weights, self._spare
            self.flat.bind(weights)

    def _take(self, received: Weights | None) -> None:
        """Overlap: the model takes the weights an exchange brought (on the CPU it moves onto the
        spare buffer they came into); None (none came) leaves it and its timestamp as they are."""
        if received is not None:
            self._swap()
        self._arrived(received, wait=True)

    def _send_from(
        self,
        grads: Gradient,
        weights_in: np.ndarray,
        stamp: Stamp,
        step: int,
        samples: int,
        loss: float | None,
        lr: list[float] | None,
    ) -> Weights | None:
        self.client.set_weights_buffer(weights_in)
        return self._exchange(grads, stamp, step, samples, loss, lr)

    def _exchange(
        self, grads: Gradient, stamp: Stamp, step: int, samples: int, loss: float | None, lr: list[float] | None
    ) -> Weights | None:
        """push+pull, surviving a lost server for ``reconnect`` seconds (the gradient is then
        lost). A push refused because the run is over is followed by a pull of the run's final
        weights (so that a learner that joined late still ends with the trained model); None
        if even those cannot be had."""
        try:
            weights = self.client.push_pull(grads, stamp, step, samples, loss, lr)
            if not self._group_ended:  # (then nothing was sent)
                self.pushes += 1
            self._refused_in_a_row = 0
            return weights
        except RemoteError as exc:
            if exc.code in SKIPPED_REFUSALS:
                return self._refused(exc)
            if exc.code != "stopped":
                raise
        except TransportError as exc:  # a server shutting down says why (PeerGone with its reason)
            if not self.reconnect:
                raise
            return self._reconnect(exc, stamp)
        try:  # the run is over: its final weights
            return self.client.pull()
        except (RemoteError, TransportError):
            return None

    def _refused(self, refusal: RemoteError) -> Weights:
        """The server refused this gradient as an outlier (one mini-batch's spike, or the start
        of a divergence): go on from the server's weights, warning now and then; the
        :data:`MAX_REFUSED_IN_A_ROW`-th refusal in a row is a LearnerError."""
        self.refused += 1
        self._refused_in_a_row += 1
        if self._refused_in_a_row >= MAX_REFUSED_IN_A_ROW:
            raise LearnerError(
                f"the server refused {self._refused_in_a_row} gradients in a row ({refusal}): training is "
                "diverging; lower the learning rate (or raise the server's --grad-outlier-factor)"
            )
        if self.refused == 1 or self.refused % 100 == 0:
            log.warning(
                "the server refused a gradient (%s; %d so far): going on from its weights", refusal, self.refused
            )
        return self.client.pull()

    def _reconnect(self, lost: Exception, stamp: Stamp) -> Weights:
        """Reach the server again (for up to ``reconnect`` seconds) and take the run's state."""
        log.warning("lost the server (%s); reconnecting for up to %g s", lost, self.reconnect)
        weights = self.client.reconnect(self.reconnect)
        self.reconnects += 1
        self._sent_lr = None  # the server may have restarted: the next push says the rates again
        self._take_run_state()
        if went_back(weights.timestamp, stamp):
            if self.client.resumed_from is not None:
                log.warning("the server resumed from its checkpoint of update %s (it was at %s; the updates "
                            "since that checkpoint are lost)", self.client.resumed_from, stamp)  # fmt: skip
            else:
                log.warning("the server's clock went back from %s to %s: it restarted without its checkpoint",
                            stamp, weights.timestamp)  # fmt: skip
        return weights

    def _take_run_state(self) -> None:
        """Send every state tensor (the first learner's become the run's) and take the run's."""
        if not self.model_state:
            return
        values = self.client.exchange_state(self.model_state.values(), every=True, reply=True)
        differed = self.model_state.load(values)
        if differed:
            log.warning(
                "frozen parameter(s) %s differed from the run's; this learner takes the run's", ", ".join(differed)
            )

    def _report_buffers(self) -> None:
        """Tell the server this learner's buffers (it combines them into the run's)."""
        if self.model_state.has_buffers:
            self._call(lambda: self.client.exchange_state(self.model_state.buffers(), every=False, reply=False))

    def _arrived(self, weights: Weights | None, wait: bool = False) -> None:
        """Note the weights that came (None: none did, the run is over)."""
        if weights is None:
            self.stopped = True
            return
        self.timestamp: Stamp = weights.timestamp
        self.stopped = weights.stop
        self.flat.load(wait)

    def _call(self, fn: Callable[[], T]) -> T:
        """Run a client call in the client's thread."""
        return fn() if self._worker is None else self._worker.submit(fn).result()

    # -- life cycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Finish an exchange in flight, report the buffers, say bye and close; the model keeps
        the newest weights and loses this optimizer's hooks. Idempotent."""
        self.flat.close()
        if self._pending is not None:
            try:
                self._take(self._last_exchange())  # the model ends on the newest weights, if any came
                self._pending = None
            except Exception as exc:  # the last exchange failed; closing goes on
                log.warning("the last exchange failed while closing: %s", exc)
        client = getattr(self, "client", None)
        if client is not None:
            try:
                self._report_buffers()
            except Exception as exc:  # the server is gone: closing goes on
                log.warning("could not report the buffers while closing: %s", exc)
            self._call(client.close)
            del self.client
        if self._worker is not None:
            self._worker.shutdown()

    def __enter__(self) -> DistributedOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _server_groups(params: list[nn.Parameter], welcome: dict[str, Any]) -> list[dict[str, Any]]:
    """Parameter groups as the server has them (for a wrapper made without an optimizer):
    the rates in force, the weight decay, momentum and nesterov."""
    groups, start = [], 0
    for (count, _, decay), rate in zip(welcome["groups"], welcome["lr"]):
        groups.append(
            {
                "params": params[start : start + count],
                "lr": rate,
                "weight_decay": decay,
                "momentum": welcome["momentum"],
                "nesterov": welcome["nesterov"],
                "dampening": 0,
            }
        )
        start += count
    return groups

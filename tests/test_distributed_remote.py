"""Learner ranks that join from another machine (issue 17 item 1): rank 1 is started by torchrun,
as an operator starts it on a second machine, with the rendezvous address only; rank 0 is the
hub's child. The step equals the one-process learner's, the KL reference included (the remote
rank gets its initial weights from rank 0), and the remote rank stops with the hub's learner."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
from typing import Any

import pytest
from test_distributed_learner import KW, _groups, _model, _rel

from echo2.learner_hub.config import ConfigError, HubConfig, check_sampling
from echo2.learner_hub.distributed import ShardedLearner
from echo2.learner_hub.learner import Learner
from echo2.learner_hub.rank import remote_command


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow  # ~40 s quiet: three interpreters import torch; the 2-rank tests in the default run cover FSDP2
@pytest.mark.timeout(400)
def test_a_rank_started_by_torchrun_joins_and_matches_one_process() -> None:
    model, mc, tok = _model()
    groups = _groups(model, tok)
    kw: dict[str, Any] = {**KW, "kl_coef": 0.1}
    one = Learner(copy.deepcopy(model), tok, ref_model=copy.deepcopy(model).eval().requires_grad_(False), **kw)
    s1 = one.step(groups)
    port = _port()
    cmd = remote_command("127.0.0.1", port, world=2, first_rank=1, nproc=1).split()
    assert cmd[0] == "torchrun"
    # torchrun is torch.distributed.run: the same launcher, without relying on the venv's PATH
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    remote = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *cmd[1:]], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sharded = None
    try:
        sharded = ShardedLearner(copy.deepcopy(model), tok, mc, procs=2, local_procs=1, port=port, start_timeout_s=300, **kw)
        assert len(sharded._procs) == 1  # only rank 0 is the hub's
        s2 = sharded.step(groups)
        assert s2.version == 1 and abs(s2.loss - s1.loss) <= 1e-5 * abs(s1.loss)
        assert abs(s2.grad_norm - s1.grad_norm) <= 1e-5 * s1.grad_norm
        w1, w2 = one.state_dict_for_publish(), sharded.state_dict_for_publish()
        assert w1.keys() == w2.keys()
        for k in w1:
            assert _rel(w2[k], w1[k]) <= 1e-5, k
        sharded.close()
        out, _ = remote.communicate(timeout=120)
        assert remote.returncode == 0, out[-2000:]
        assert "learner rank 1 of 2: joining" in out
    finally:
        if sharded is not None:
            sharded.close()
        if remote.poll() is None:
            remote.kill()
            remote.wait(timeout=30)


def test_remote_ranks_need_a_fixed_port() -> None:
    model, mc, tok = _model()
    with pytest.raises(ValueError, match="fixed rendezvous port"):
        ShardedLearner(model, tok, mc, procs=2, local_procs=1, port=0)
    with pytest.raises(ConfigError, match="learner_master_port"):
        check_sampling(HubConfig(learner_procs=3, learner_local_procs=1))
    with pytest.raises(ConfigError, match="learner_local_procs"):
        check_sampling(HubConfig(learner_procs=2, learner_local_procs=3))
    check_sampling(HubConfig(learner_procs=3, learner_local_procs=1, learner_master_port=29500))

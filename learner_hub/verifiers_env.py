"""A verifiers environment as an echo2 recipe: its tasks become a dataset, its rewards TRL-form callables.

``environment = "ENV_ID"`` names a verifiers (>= 0.4, the ``verifiers.v1`` stack) taskset: verifiers
finds it by importing the module named after the id (``my-env`` -> ``my_env``) and taking the
``Taskset`` subclass that module exports through ``__all__``; ``environment_args`` are that
taskset's config fields. echo2's nodes produce one completion per prompt, which is what verifiers'
tool-less ``null`` harness does with a task that offers no tools: one model reply. So only that is
accepted: the plain ``SingleAgentEnv``, no bundled harness, no tools, no sandbox, no stop hooks, no
LLM judge, rewards computable from the task and the transcript alone. Anything else is refused with
a ConfigError naming the class and the method that needs more.

Each reward function of the task (its ``@vf.reward`` methods merged with config-plugged ones, in
verifiers' order) becomes one callable on TRL's convention, and its ``@vf.reward(weight=...)`` is
the weight, so ``sum(w * r)`` is verifiers' own ``Trace.reward``. The callable rebuilds each row's
Task from the ``info`` column (the task's wire data, as verifiers' replay does) and a Trace holding
the prompt and the completion, then calls the reward the way ``Task.score`` does.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from echo2.learner_hub.config import ConfigError

if TYPE_CHECKING:
    import datasets

RewardFunc = Callable[..., list[float | None]]

_INSTALL_HINT = "pip install echo2[verifiers]"
_MAX_TASKS = 1_000_000  # a taskset is materialised into a Dataset: refuse one that never ends


def load_environment_recipe(
    env_id: str, env_args: dict[str, Any]
) -> tuple[datasets.Dataset, datasets.Dataset | None, list[RewardFunc], list[float]]:
    """``(dataset, eval_dataset, reward_funcs, reward_weights)`` of the verifiers environment ``env_id``.

    Dataset rows: ``prompt`` (a list of ``{"role", "content"}`` messages, the task's system prompt
    first), ``answer`` (when the task data has one), ``info`` (the task's wire data as JSON) and
    ``task`` (the environment id). A verifiers taskset is one stream of tasks with no held-out
    split, so ``eval_dataset`` is None.
    """
    vf = _import_verifiers()
    import datasets

    env = _load(vf, env_id, env_args)
    try:  # the environment's own code runs here (toolsets(), load(), hooks()): its failures are config errors
        _require_single_turn(vf, env, env_id)
        taskset = env.taskset
        task_cls = type(taskset).task_type()
        tasks = _materialise(taskset, env_id)
        hooks = _reward_hooks(vf, tasks[0], env_id)
        rows = [_row(task, env_id) for task in tasks]
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"environment = {env_id!r} failed to load its tasks: {type(e).__name__}: {e}") from e
    dataset = datasets.Dataset.from_list(rows)
    rebuild = _TaskRebuilder(task_cls, taskset.config.task)
    funcs: list[RewardFunc] = [_RubricReward(vf, env_id, name, rebuild) for name, _ in hooks]
    weights = [weight for _, weight in hooks]
    return dataset, None, funcs, weights


def _import_verifiers() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        if e.name == "verifiers":
            raise ConfigError(f"environment = ...: verifiers is not installed ({_INSTALL_HINT})") from e
        if e.name == "verifiers.v1":
            raise ConfigError(
                "environment = ...: the installed verifiers has no verifiers.v1 stack; echo2 needs "
                f"verifiers >= 0.4 ({_INSTALL_HINT})"
            ) from e
        raise ConfigError(f"environment = ...: verifiers failed to import: {e} ({_INSTALL_HINT})") from e
    return vf


def _load(vf: Any, env_id: str, env_args: dict[str, Any]) -> Any:
    if not env_id:
        raise ConfigError("environment: empty environment id")
    if "id" in env_args:
        raise ConfigError("environment_args: 'id' is the environment itself; set environment = ... instead")
    try:
        config = vf.resolve_env_config({"taskset": {**env_args, "id": env_id}})
        return vf.load_environment(config)
    except ImportError as e:  # the module is missing, or one of its own dependencies is
        # verifiers reports a module whose own import failed as "not found": name the real culprit
        cause = e.__cause__
        if isinstance(cause, ImportError) and cause.name and cause.name.split(".")[0] != _module_name(env_id):
            raise ConfigError(f"environment = {env_id!r}: its module failed to import: {cause}") from e
        raise ConfigError(f"environment = {env_id!r}: {e}") from e
    except (ValueError, TypeError, AttributeError) as e:  # pydantic's ValidationError is a ValueError
        if _is_classic(vf, env_id):
            raise ConfigError(
                f"environment = {env_id!r} is written for the classic verifiers API (a module-level "
                "load_environment() returning vf.SingleTurnEnv), which verifiers 0.4 removed; echo2 loads "
                "verifiers.v1 tasksets: a module exporting its vf.Taskset subclass through __all__, "
                "rewards as @vf.reward methods of its vf.Task"
            ) from e
        raise ConfigError(f"environment = {env_id!r} with environment_args {env_args!r}: {e}") from e
    except Exception as e:  # the environment's own construction code
        raise ConfigError(f"environment = {env_id!r} failed to load: {type(e).__name__}: {e}") from e


def _module_name(env_id: str) -> str:
    # verifiers' own mapping of an id to its module (hub ids are owner/name@version)
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def _is_classic(vf: Any, env_id: str) -> bool:
    """The id names a module with a classic ``load_environment`` and no v1 Taskset export."""
    try:
        module = vf.import_taskset(env_id)
    except Exception:  # only a hint for the error being raised: never a second failure
        return False
    exported = [getattr(module, name, None) for name in getattr(module, "__all__", [])]
    has_taskset = any(isinstance(obj, type) and issubclass(obj, vf.Taskset) for obj in exported)
    return callable(getattr(module, "load_environment", None)) and not has_taskset


def _refuse(env_id: str, what: str, why: str) -> ConfigError:
    return ConfigError(
        f"environment = {env_id!r} is not single-turn: {what} {why}; echo2 nodes produce one "
        "completion per prompt and run no tool loop, sandbox or second agent"
    )


def _overrides(cls: type, base: type, method: str) -> bool:
    return getattr(cls, method, None) is not getattr(base, method, None)


def _needs_runtime(fn: Callable[..., Any]) -> bool:
    # Task.score's own test: a `runtime` parameter without a default can only run in a sandbox.
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def _require_single_turn(vf: Any, env: Any, env_id: str) -> None:
    """Everything that would make verifiers run more than one model reply, or need a sandbox."""
    if type(env) is not vf.SingleAgentEnv:
        raise _refuse(
            env_id,
            f"it runs Env class {type(env).__name__}",
            "whose run() plays its own episode (several agents or turns)",
        )
    harness = env._default_harness.id
    if harness != "bash":  # the taskset ships its own agent program
        raise _refuse(env_id, f"its taskset bundles harness {harness!r}", "whose launch() runs an agent program")
    taskset_cls = type(env.taskset)
    task_cls = taskset_cls.task_type()
    if taskset_cls.toolsets(env.taskset.config):
        raise _refuse(env_id, f"{taskset_cls.__name__}.toolsets()", "gives the model tools (a multi-turn tool loop)")
    if task_cls.toolsets(env.taskset.config.task):
        raise _refuse(env_id, f"{task_cls.__name__}.toolsets()", "gives the model tools (a multi-turn tool loop)")
    if task_cls.NEEDS_CONTAINER:
        raise _refuse(env_id, f"{task_cls.__name__}.NEEDS_CONTAINER", "asks for a container sandbox")
    for method in ("setup", "finalize", "stage_verifier"):
        if _overrides(task_cls, vf.Task, method):
            raise _refuse(env_id, f"{task_cls.__name__}.{method}()", "prepares a runtime (sandbox) around the rollout")
    judges = env.taskset.config.task.judges
    if judges:
        ids = ", ".join(judge.id for judge in judges)
        raise ConfigError(
            f"environment = {env_id!r}: its task config plugs judges ({ids}), whose Judge.score() asks an "
            "LLM through a model client, which echo2's hub does not have; drop taskset.task.judges"
        )


def _materialise(taskset: Any, env_id: str) -> list[Any]:
    if not taskset.bounded:
        raise ConfigError(
            f"environment = {env_id!r}: {type(taskset).__name__} is infinite (INFINITE = True) and a "
            "dataset must be finite"
        )
    tasks = []
    for task in taskset:
        tasks.append(task)
        if len(tasks) > _MAX_TASKS:
            raise ConfigError(f"environment = {env_id!r}: more than {_MAX_TASKS} tasks")
    if not tasks:
        raise ConfigError(f"environment = {env_id!r}: its taskset yielded no tasks")
    return tasks


def _reward_hooks(vf: Any, task: Any, env_id: str) -> list[tuple[str, float]]:
    """(name, weight) of each reward function, in the order verifiers runs them."""
    stops = task.hooks("stop")
    if stops:
        names = ", ".join(fn.__name__ for fn in stops)
        raise _refuse(env_id, f"{type(task).__name__} stop hooks ({names})", "end a multi-turn rollout")
    hooks = task.hooks("reward")
    if not hooks:
        raise ConfigError(f"environment = {env_id!r}: {type(task).__name__} defines no @vf.reward function")
    for fn in hooks:
        if _needs_runtime(fn):
            raise _refuse(env_id, f"reward {type(task).__name__}.{fn.__name__}()", "needs a runtime (sandbox)")
    return [(fn.__name__, float(getattr(fn, "_vf_weight", 1.0))) for fn in hooks]


def _text(content: Any, env_id: str) -> str:
    if isinstance(content, str):
        return content
    raise ConfigError(f"environment = {env_id!r}: a prompt message is not plain text (multimodal content)")


def _prompt_messages(data: Any, env_id: str) -> list[dict[str, str]]:
    """The prompt as verifiers' chat harness sends it: the system prompt as its own message first."""
    messages: list[dict[str, str]] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    prompt = data.prompt
    if prompt is None:
        raise ConfigError(f"environment = {env_id!r}: task {data.idx} has no prompt (the user opens it: multi-turn)")
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
        return messages
    for message in prompt:
        if message.role not in ("system", "user", "assistant") or getattr(message, "tool_calls", None):
            raise ConfigError(f"environment = {env_id!r}: task {data.idx} prompt holds a {message.role} tool turn")
        messages.append({"role": message.role, "content": _text(message.content, env_id)})
    return messages


def _row(task: Any, env_id: str) -> dict[str, Any]:
    data = task.data
    row: dict[str, Any] = {"prompt": _prompt_messages(data, env_id)}
    answer = getattr(data, "answer", None)
    if answer is not None:
        row["answer"] = answer if isinstance(answer, str) else json.dumps(answer)
    row["info"] = json.dumps(data.model_dump(mode="json", exclude_none=True), sort_keys=True)
    row["task"] = env_id
    return row


class _TaskRebuilder:
    """The Task of a row and its reward functions by name, from the row's ``info`` column
    (verifiers' replay rebuilds tasks the same way); cached, as plugged rewards import on lookup."""

    def __init__(self, task_cls: Any, task_config: Any) -> None:
        self._task_cls = task_cls
        self._data_cls = task_cls.data_type()
        self._config = task_config
        self.get = functools.lru_cache(maxsize=4096)(self._build)

    def _build(self, info: str) -> tuple[Any, dict[str, Callable[..., Any]]]:
        task = self._task_cls(self._data_cls.model_validate_json(info), self._config)
        return task, {fn.__name__: fn for fn in task.hooks("reward")}


def _completion_texts(completion: Any) -> list[str]:
    """A TRL completion (a string, or a list of assistant messages) as the assistant replies."""
    if isinstance(completion, str):
        return [completion]
    if isinstance(completion, Sequence):
        texts = []
        for message in completion:
            if not isinstance(message, Mapping) or message.get("role", "assistant") != "assistant":
                raise ValueError(f"completion message is not an assistant message: {message!r:.80}")
            texts.append(str(message.get("content") or ""))
        return texts
    raise ValueError(f"completion is neither a string nor a list of messages: {type(completion).__name__}")


def _score(name: str, value: Any) -> float | None:
    """A verifiers reward result as one number: keyed scores share the function's weight, so their sum."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        if any(v is None for v in value.values()):
            return None
        return math.fsum(float(v) for v in value.values())
    if isinstance(value, bool | int | float):
        return float(value)
    raise TypeError(f"reward {name} returned {type(value).__name__}, not a number")


class _RubricReward:
    """One verifiers reward function on TRL's calling convention (``__name__`` for the hub's logs)."""

    def __init__(self, vf: Any, env_id: str, name: str, rebuild: _TaskRebuilder) -> None:
        from pydantic import TypeAdapter
        from verifiers.v1.types import Message
        from verifiers.v1.utils.decorators import invoke

        self._vf = vf
        self._invoke = invoke
        self._message: TypeAdapter[Any] = TypeAdapter(Message)
        self._env_id = env_id
        self._reward = name
        self._rebuild = rebuild
        self._agent = vf.AgentInfo(config=vf.AgentConfig())
        self.__name__ = f"{env_id}:{name}"

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]] | None = None,
        trainer_state: Any = None,
        *,
        info: list[str],
        **columns: Any,
    ) -> list[float | None]:
        if len(info) != len(completions):
            raise ValueError(f"{len(completions)} completions but {len(info)} info values")
        results: list[Any] = []
        try:
            for row_info, completion in zip(info, completions, strict=True):
                results.append(self._call(row_info, completion))
        except BaseException:
            for r in results:  # the rows before the failing one: no "never awaited" warnings
                if inspect.iscoroutine(r):
                    r.close()
            raise
        if any(inspect.isawaitable(r) for r in results):
            results = _drive(results)
        return [_score(self.__name__, r) for r in results]

    def _call(self, info: str, completion: Any) -> Any:
        task, hooks = self._rebuild.get(info)
        hook = hooks.get(self._reward)
        if hook is None:
            raise ValueError(f"task {task.data.idx} has no reward {self._reward}")
        # the arguments Task.score hands a reward: the task data and the trace, by parameter name
        return self._invoke(hook, {"task": task.data, "trace": self._trace(task, completion)})

    def _trace(self, task: Any, completion: Any) -> Any:
        vf = self._vf
        nodes: list[Any] = []
        for m in _prompt_messages(task.data, self._env_id):
            parent = len(nodes) - 1 if nodes else None
            nodes.append(vf.MessageNode(parent=parent, message=self._message.validate_python(m)))
        for text in _completion_texts(completion):
            parent = len(nodes) - 1 if nodes else None
            nodes.append(vf.MessageNode(parent=parent, message=vf.AssistantMessage(content=text), sampled=True))
        trace_task = vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash)
        return vf.Trace(task=trace_task, agent=self._agent, nodes=nodes, is_completed=True, ok=True)


def _drive(results: list[Any]) -> list[Any]:
    """Await the async rewards of one batch.

    The hub calls reward functions in a worker thread, so this runs its own short-lived asyncio
    loop there (``asyncio.run``: created, run to completion, closed) and never touches the hub's
    trio loop; the hub's per-batch timeout bounds it like any other reward call.
    """

    async def gather() -> list[Any]:
        return list(await asyncio.gather(*(_as_coroutine(r) for r in results)))

    return asyncio.run(gather())


async def _as_coroutine(value: Any) -> Any:
    return (await value) if inspect.isawaitable(value) else value

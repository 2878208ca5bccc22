"""EngineConfig: one engine's settings, a validated section per concern, and the rules that span two
of them; `from_kwargs` sorts flat keyword arguments into the sections (config/args.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..errors import ConfigError, NanoserveError
from .args import ENGINE_ARGS, unknown_argument_message
from .cache import CacheConfig
from .load import LoadConfig
from .lora import LoRAConfig, lora_section
from .parallel import ParallelConfig
from .scheduler import SchedulerConfig
from .speculative import SpeculativeConfig, speculative_section
from .structured_outputs import GrammarLimits, structured_outputs_section


@dataclass
class EngineConfig:
    """One engine's settings, a section per concern (config/__init__.py lists them)."""

    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None
    structured_outputs: GrammarLimits = field(default_factory=GrammarLimits)

    def __post_init__(self):
        for f in fields(self):
            want = SECTION_TYPES[f.name]
            value = getattr(self, f.name)
            optional = f.name in ("speculative", "lora")
            if not isinstance(value, want) and not (optional and value is None):
                raise ConfigError(f"EngineConfig.{f.name} must be a {want.__name__}, "
                                  f"got {type(value).__name__}")
        self._check_parallel()
        self._check_async_scheduling()

    def _check_async_scheduling(self) -> None:
        """What a step launched before the last one's tokens are known cannot run, refused by
        name."""
        if not self.scheduler.async_scheduling:
            return
        if self.speculative is not None:
            raise NanoserveError("async_scheduling does not combine with speculative decoding "
                                 "(drafting needs the last token on the host); turn one off")
        if self.parallel.world_size > 1:
            raise NanoserveError("async_scheduling is not supported with "
                                 f"{self.parallel.size_name} yet")

    def _check_parallel(self) -> None:
        """What the split engine does not run yet, refused by name."""
        if self.parallel.world_size == 1:
            return
        if self.speculative is not None:
            raise NanoserveError("speculative decoding is not supported with "
                                 f"{self.parallel.size_name} yet")
        if self.lora is not None:
            raise NanoserveError(f"enable_lora is not supported with {self.parallel.size_name} yet")

    @property
    def model(self) -> str:
        return self.load.model

    @classmethod
    def from_kwargs(cls, model: str = "demo", **kwargs) -> EngineConfig:
        """The config of flat keyword arguments (`max_num_seqs=8`), each sorted into its section by
        ENGINE_ARGS. An unknown name, or an option of a feature that is off, is an error."""
        unknown = [name for name in kwargs if name not in ENGINE_ARGS]
        if unknown:
            raise ConfigError(unknown_argument_message(unknown[0]))
        sections: dict[str, dict] = {}
        for name, value in kwargs.items():
            arg = ENGINE_ARGS[name]
            sections.setdefault(arg.section, {})[arg.field] = value
        load = LoadConfig(model=model, **sections.get("load", {}))
        return cls(load=load,
                   cache=CacheConfig(**sections.get("cache", {})),
                   scheduler=SchedulerConfig(**sections.get("scheduler", {})),
                   parallel=ParallelConfig(**sections.get("parallel", {})),
                   speculative=speculative_section(sections.get("speculative", {})),
                   lora=lora_section(sections.get("lora", {})),
                   structured_outputs=structured_outputs_section(
                       sections.get("structured_outputs", {})))


SECTION_TYPES = {"load": LoadConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                 "parallel": ParallelConfig, "speculative": SpeculativeConfig, "lora": LoRAConfig,
                 "structured_outputs": GrammarLimits}

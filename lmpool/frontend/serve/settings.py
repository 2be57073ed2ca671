"""What ``lmpool serve`` was asked for; importable without the serve extra (the command line
reads its arguments into it before FastAPI is needed)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServeSettings:
    """The model, its public name, the optional API key, and the pool's arguments."""

    model: str
    served_model_name: str | None = None
    api_key: str | None = None
    pool_args: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

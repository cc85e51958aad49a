"""The click-log feed the ``click_log_sensor`` watches: where drops arrive and how they become datasets."""

from __future__ import annotations

import logging

import dagster as dg
import pydantic

from xc_dagster.home import Home
from xc_dagster.serving.retraining import HISTORY, feed_names, feed_root

log = logging.getLogger("xc_dagster")


class ClickLogFeedResource(dg.ConfigurableResource):
    """``root``: a local folder or an fsspec URI (``s3://bucket/clicks``) holding one folder per dataset;
    empty = ``$XC_CLICKLOG_ROOT``, else ``$XC_HOME/clicklog-inbox``. See ``docs/AUTOMATION.md``."""

    root: str = pydantic.Field(default="", description="feed root; empty = $XC_CLICKLOG_ROOT or "
                                                       "$XC_HOME/clicklog-inbox")
    history: str = pydantic.Field(default="drop", description="build each dataset from the drop's new files "
                                                              "('drop') or from every file of its feed ('all')")
    min_clicks: int = pydantic.Field(default=1, ge=1, description="clicks for a (query, label) pair to count")
    test_fraction: float = pydantic.Field(default=0.2, gt=0.0, lt=1.0,
                                          description="latest fraction of each drop's queries -> test split")
    settle_seconds: float = pydantic.Field(default=60.0, ge=0.0,
                                           description="a drop waits until its newest file is this old "
                                                       "(files still being uploaded)")

    @pydantic.field_validator("history")
    @classmethod
    def _history(cls, v: str) -> str:
        if v not in HISTORY:
            raise ValueError(f"history must be one of {HISTORY}, got {v!r}")
        return v

    def root_for(self, home: Home) -> str:
        return feed_root(home, self.root)

    def partition_names(self, home: Home) -> list[str]:
        """The feed's dataset folders, as partitions at load time (empty when the root cannot be listed)."""
        try:
            return feed_names(self.root_for(home))
        except Exception as e:  # a remote root that cannot be reached must not stop the code location
            log.warning("click-log feed %s not listed: %s", self.root_for(home), e)
            return []

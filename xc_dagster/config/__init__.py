"""Hyperparameters of every stage, presets, and how overrides are layered.

One dataclass per stage (``params``) holds that stage's hyperparameters with the ``quick`` preset's values as
defaults (the whole pipeline on LF-WordNetNouns Titles in 8 to 30 minutes of training on 2 CPU cores, depending on
the CPU). ``PRESETS`` lists the values other presets change (``paper``: the papers' values, meant for a GPU). The
effective value of a field is, last one wins: dataclass default < preset < strategy < dataset options < catalog
overrides < run config (``resolve``). Overrides are addressed as ``stage.field`` (``pretrain.epochs=2``);
``resolve_config`` checks every name and coerces every value to the field's type, so a typo fails before any work
with the field named; a field whose values are a fixed set is typed ``Literal[...]`` (``choices``: the names of the
component registries) and a value outside it fails listing the allowed ones. ``describe`` says which value each
preset and strategy gives a field (the launchpad's descriptions). Every field is described in
``docs/configuration.md``.
"""

from xc_dagster.config.choices import literal_choices
from xc_dagster.config.describe import describe_default, describe_field, describe_stage, field_defaults
from xc_dagster.config.params import (
                                      STAGES,
                                      ClassifierCommonParams,
                                      ClassifierParams,
                                      EndToEndParams,
                                      EndToEndTrainerParams,
                                      EvaluateParams,
                                      FusionParams,
                                      HardNegativeParams,
                                      HardNegativeTrainerParams,
                                      IndexParams,
                                      IngestParams,
                                      MiningParams,
                                      PretrainParams,
                                      SampledNegativeParams,
                                      TokenizeParams,
                                      TrainParams,
)
from xc_dagster.config.resolve import PRESETS, PipelineConfig, apply_overrides, parse_set_options, resolve_config

__all__ = ["STAGES", "PRESETS", "PipelineConfig", "apply_overrides", "parse_set_options", "resolve_config",
           "literal_choices", "describe_default", "describe_field", "describe_stage", "field_defaults",
           "TrainParams", "IngestParams", "TokenizeParams", "PretrainParams", "MiningParams", "ClassifierParams",
           "ClassifierCommonParams", "HardNegativeParams", "SampledNegativeParams", "EndToEndParams",
           "HardNegativeTrainerParams", "EndToEndTrainerParams", "FusionParams", "IndexParams", "EvaluateParams"]

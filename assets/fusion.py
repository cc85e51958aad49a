"""Fusion fitting: the blend a * classifier + (1 - a) * embedding score, with a fitted on the shortlists of the validation points carved from train."""

from assets._stage import stage_asset

build = stage_asset("fusion", "fusion", deps=["ann_index"],
                    group="inference", kinds={"scikitlearn"}, description=__doc__)

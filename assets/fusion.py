"""Fusion fitting on the shortlists of the validation points carved from train: `fusion.method=alpha`
(SiameseXML: a * classifier + (1 - a) * embedding score, a by grid search) or `tree` (NGAME: a depth-7 decision
tree on embedding score, classifier score and inverse propensity; final score T(d) + z.e + w.e)."""

from assets._stage import stage_asset

build = stage_asset("fusion", group="inference", kinds={"scikitlearn"}, description=__doc__)

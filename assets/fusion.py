"""Fusion fitting on the shortlists of the validation points carved from train: `fusion.method=alpha`
(SiameseXML: a * classifier + (1 - a) * embedding score, a by grid search) or `tree` (NGAME: a depth-7 decision
tree on embedding score, classifier score and inverse propensity; final score T(d) + z.e + w.e). Cross-fitted
(`fusion.fit_on=cross_fit`) it retrains the classifiers on the device once per fold: a training step."""

from assets._stage import stage_asset
from xc_dagster.home import TRAINING_POOL

build = stage_asset("fusion", group="inference", kinds={"scikitlearn"}, description=__doc__, pool=TRAINING_POOL)

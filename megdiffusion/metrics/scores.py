"""The metrics of a generated set against a real one, on the sets' :class:`fid.Statistics`: FID, KID and
precision/recall, as the fid script, the training's ``--fid_every`` and the demo compute and print them."""
from megdiffusion.metrics import kid_pr
from megdiffusion.metrics.fid import FIDError, fid_between

METRICS = ("fid", "kid", "pr")
FEATURE_NETWORK = "Inception-v3 pool3"  # the features of every metric here


def parse_metrics(text, flag="--metrics"):
    """The metric names of a comma-separated list such as "fid,kid" ("all": every one), in ``METRICS`` order; the
    error names ``flag``."""
    names = {name.strip() for name in text.split(",")}
    if names == {"all"}:
        return METRICS
    if "all" in names:
        raise FIDError(f"'all' stands alone in {flag} (it means {','.join(METRICS)}); got {text!r}")
    unknown = sorted(names - set(METRICS))
    if unknown:
        raise FIDError(f"unknown metric {', '.join(map(repr, unknown))} in {flag} {text!r}; choose from "
                       f"{', '.join(METRICS)} or all")
    return tuple(name for name in METRICS if name in names)


def needs_features(metrics):
    """Whether ``metrics`` need the sets' features, not only mu and sigma."""
    return "kid" in metrics or "pr" in metrics


def check_sizes(metrics, n_generated, n_real, kid_subset_size=None):
    """FIDError, before any work, when sets of these sizes are too small for ``metrics``."""
    if "kid" in metrics:
        kid_pr.kid_subset_size(n_generated, n_real, kid_subset_size)
    if "pr" in metrics:
        kid_pr.check_precision_recall_sizes(n_generated, n_real)


def compare(generated, real, metrics=("fid",), kid_subsets=kid_pr.KID_SUBSETS, kid_subset_size=None,
            kid_seed=kid_pr.KID_SEED):
    """``metrics`` of the ``generated`` statistics against the ``real`` ones, as a flat dict of numbers: fid; kid,
    kid_std, kid_subsets, kid_subset_size; precision, recall, f_score."""
    scores = {}
    if "fid" in metrics:
        scores["fid"] = fid_between(generated, real)
    if "kid" in metrics:
        kid = kid_pr.kernel_inception_distance(generated.features, real.features, kid_subsets, kid_subset_size,
                                               kid_seed)
        scores.update(kid=kid.mean, kid_std=kid.std, kid_subsets=kid_subsets, kid_subset_size=kid.subset_size)
    if "pr" in metrics:
        scores.update(kid_pr.precision_recall(generated.features, real.features)._asdict())
    return scores


def score_lines(scores):
    """One line per metric in ``scores`` (from :func:`compare`), each naming its features."""
    lines = []
    if "fid" in scores:
        lines.append(f"FID: {scores['fid']:.4f}")
    if "kid" in scores:
        lines.append(f"KID ({FEATURE_NETWORK}, {scores['kid_subsets']} subsets of {scores['kid_subset_size']}): "
                     f"{scores['kid'] * 1e3:.2f} ± {scores['kid_std'] * 1e3:.2f} x 1e-3")
    if "precision" in scores:
        lines.append(f"precision {scores['precision']:.4f} recall {scores['recall']:.4f} F {scores['f_score']:.4f} "
                     f"({FEATURE_NETWORK}, k={kid_pr.NEIGHBOURS})")
    return lines

#!/usr/bin/env python3
"""bench/stats.py: statistics for bench/ results, Python 3 standard library only.

Subcommands (each has --help):

  summarize FILE...       median/min/max/mean/stddev/n of sample files, as JSON (one object
                          per file, one per line)
  median FILE             the median of one sample file, as a bare JSON number (null if empty)
  compare BASE OTHER      ministat's comparison of OTHER against BASE: difference of means with
                          a Student's t confidence interval (pooled variance), or "No difference
                          proven at C% confidence"
  ratios RESULTS.jsonl    ours / theirs table (throughput, CPU per GB, rates, p99) and the
                          issue's targets (--targets)
  plotdata RESULTS OUTDIR data files and gnuplot settings for bench/plot.sh (not for people)
  selftest                checks the Student's t quantiles against closed forms and ministat's
                          own table; with --ministat, against the ministat binary as well

A sample file holds one number per line (the first field of the line; blank lines and lines
starting with '#' are skipped), as ministat reads it: one file per relay for a workload and
parameter, e.g. <date>-<host>-samples/bulk/100x10MiB/haproxy-splice.txt.

About ministat's "99.5%": ministat's table column labelled 99.5% holds the one-sided 0.999
quantile of Student's t (318.313 for 1 degree of freedom), i.e. a two-sided 99.8% interval, not
99.5% (which would be 127.321). `compare` reproduces ministat by default, so its output can be
checked against `ministat -c 99.5` and against the numbers the nc method was published with; that
interval is wider (more conservative) than a true 99.5% one. `--exact` uses the true two-sided
quantile at the stated level instead, for any level. The table also has 7 cells off in the third
decimal (that column, df 1 and 7-12, e.g. 4.499 at df 8 where t_0.999 = 4.5008; `selftest`
lists them). The default uses the table as is, so 5-run (df 8) and 7-run (df 12) comparisons
print exactly what ministat prints; the quantiles themselves (--exact, and `selftest`) come from
the regularized incomplete beta function, solved by safeguarded Newton.
"""

import argparse
import fnmatch
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile

# --------------------------------------------------------------------------- samples

def read_samples(path):
    """Numbers of a sample file: the first field of each line, as ministat reads it."""
    xs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            try:
                x = float(fields[0])
            except ValueError:
                raise SystemExit(f"stats.py: {path}:{lineno}: not a number: {fields[0]!r}")
            if not math.isfinite(x):
                raise SystemExit(f"stats.py: {path}:{lineno}: not a finite number: {fields[0]!r}")
            xs.append(x)
    return xs


def mean(xs):
    return math.fsum(xs) / len(xs)


def variance(xs):
    """Sample variance (n - 1), as ministat's Var(); two-pass for accuracy."""
    m = mean(xs)
    return math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def describe(xs):
    n = len(xs)
    if n == 0:
        return {"median": None, "min": None, "max": None, "mean": None, "stddev": None, "n": 0}
    s = sorted(xs)
    return {"median": statistics.median(s), "min": s[0], "max": s[-1], "mean": mean(s),
            "stddev": math.sqrt(variance(s)) if n > 1 else None, "n": n}


def tidy(x, digits=10):
    """A float without binary noise for JSON (10 significant digits)."""
    if x is None or isinstance(x, int):
        return x
    return float(f"{x:.{digits}g}")

# --------------------------------------------------------------------------- Student's t

def _betacf(a, b, x):
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c = 1.0
    d = 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            return h
    raise ArithmeticError(f"incomplete beta: no convergence for a={a} b={b} x={x}")


def betainc(a, b, x, y=None):
    """Regularized incomplete beta I_x(a, b); y = 1 - x may be given exactly."""
    if y is None:
        y = 1.0 - x
    if x <= 0.0:
        return 0.0
    if y <= 0.0:
        return 1.0
    lbt = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
           + a * math.log(x) + b * math.log(y))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, y) / b


def t_sf(t, df):
    """P(T > t) for Student's t with df degrees of freedom, t >= 0."""
    t2 = t * t
    return 0.5 * betainc(df / 2.0, 0.5, df / (df + t2), t2 / (df + t2))


def t_pdf(t, df):
    return math.exp(math.lgamma((df + 1) / 2.0) - math.lgamma(df / 2.0)
                    - 0.5 * math.log(df * math.pi) - (df + 1) / 2.0 * math.log1p(t * t / df))


def _solve_general(p, df):
    """t_ppf without the closed-form shortcuts (for testing the numerical path)."""
    q = 1.0 - p
    lo, hi = 0.0, max(statistics.NormalDist().inv_cdf(p), 1e-3)
    while t_sf(hi, df) > q:
        lo, hi = hi, hi * 2.0
    t = 0.5 * (lo + hi)
    for _ in range(200):
        g = t_sf(t, df) - q
        if g > 0:
            lo = t
        else:
            hi = t
        nt = t + g / t_pdf(t, df)
        if not lo < nt < hi:
            nt = 0.5 * (lo + hi)
        if abs(nt - t) <= 1e-15 * nt:
            return nt
        t = nt
    return t


def t_ppf(p, df):
    """Inverse CDF of Student's t: the t with P(T <= t) = p. df = math.inf for the normal.

    Safeguarded Newton on the survival function (computed from the regularized incomplete
    beta function), bracketed so a bad step falls back to bisection."""
    if not 0.0 < p < 1.0:
        raise ValueError("p must be in (0, 1)")
    if p < 0.5:
        return -t_ppf(1.0 - p, df)
    if p == 0.5:
        return 0.0
    if math.isinf(df) or df > 1e7:
        return statistics.NormalDist().inv_cdf(p)
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    return _solve_general(p, df)


def t_two_sided(confidence_pct, df):
    """The t for a two-sided interval at confidence_pct percent."""
    return t_ppf(1.0 - (1.0 - confidence_pct / 100.0) / 2.0, df)


# ministat's confidence levels and the one-sided probability its table really holds for each
# (its "99.5" column is t_0.999, see the module docstring).
MINISTAT_LEVELS = {80.0: 0.90, 90.0: 0.95, 95.0: 0.975, 98.0: 0.99, 99.0: 0.995, 99.5: 0.999}
MINISTAT_NSTUDENT = 100    # beyond 100 degrees of freedom ministat uses its "inf" row


def t_ministat(confidence_pct, df):
    """The t ministat applies: its table value for the level and df (row 0, 'inf', beyond
    100 df). The table is used as is, errors included (see `selftest`), so that `compare`
    prints what ministat prints."""
    if float(confidence_pct) not in MINISTAT_LEVELS:
        raise SystemExit(f"stats.py: ministat has no {confidence_pct}% level "
                         f"(only {', '.join('%g' % c for c in MINISTAT_LEVELS)}); use --exact")
    col = list(MINISTAT_LEVELS).index(float(confidence_pct))
    return MINISTAT_TABLE[0 if df > MINISTAT_NSTUDENT else df][col]


def t_sf_series(t, df):
    """P(T > t) for integer df by the closed-form series (Abramowitz & Stegun 26.7.3-4),
    independent of the incomplete beta function: used by `selftest` only."""
    th = math.atan(t / math.sqrt(df))
    c2, s = math.cos(th) ** 2, math.sin(th)
    if df % 2:
        acc, term = 0.0, math.cos(th)
        for k in range(1, (df - 1) // 2 + 1):
            if k > 1:
                term *= c2 * (2 * k - 2) / (2 * k - 1)
            acc += term
        a = 2 / math.pi * (th + s * acc) if df > 1 else 2 * th / math.pi
    else:
        acc, term = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            acc += term
        a = s * acc
    return (1.0 - a) / 2.0


# ministat's table (FreeBSD usr.bin/ministat/ministat.c, the same in Debian's ministat
# 20150715, checked by `selftest --ministat`), row 0 = infinity, columns 80 90 95 98 99 99.5.
MINISTAT_TABLE = [
    (1.282, 1.645, 1.960, 2.326, 2.576, 3.090),
    (3.078, 6.314, 12.706, 31.821, 63.657, 318.313),
    (1.886, 2.920, 4.303, 6.965, 9.925, 22.327),
    (1.638, 2.353, 3.182, 4.541, 5.841, 10.215),
    (1.533, 2.132, 2.776, 3.747, 4.604, 7.173),
    (1.476, 2.015, 2.571, 3.365, 4.032, 5.893),
    (1.440, 1.943, 2.447, 3.143, 3.707, 5.208),
    (1.415, 1.895, 2.365, 2.998, 3.499, 4.782),
    (1.397, 1.860, 2.306, 2.896, 3.355, 4.499),
    (1.383, 1.833, 2.262, 2.821, 3.250, 4.296),
    (1.372, 1.812, 2.228, 2.764, 3.169, 4.143),
    (1.363, 1.796, 2.201, 2.718, 3.106, 4.024),
    (1.356, 1.782, 2.179, 2.681, 3.055, 3.929),
    (1.350, 1.771, 2.160, 2.650, 3.012, 3.852),
    (1.345, 1.761, 2.145, 2.624, 2.977, 3.787),
    (1.341, 1.753, 2.131, 2.602, 2.947, 3.733),
    (1.337, 1.746, 2.120, 2.583, 2.921, 3.686),
    (1.333, 1.740, 2.110, 2.567, 2.898, 3.646),
    (1.330, 1.734, 2.101, 2.552, 2.878, 3.610),
    (1.328, 1.729, 2.093, 2.539, 2.861, 3.579),
    (1.325, 1.725, 2.086, 2.528, 2.845, 3.552),
    (1.323, 1.721, 2.080, 2.518, 2.831, 3.527),
    (1.321, 1.717, 2.074, 2.508, 2.819, 3.505),
    (1.319, 1.714, 2.069, 2.500, 2.807, 3.485),
    (1.318, 1.711, 2.064, 2.492, 2.797, 3.467),
    (1.316, 1.708, 2.060, 2.485, 2.787, 3.450),
    (1.315, 1.706, 2.056, 2.479, 2.779, 3.435),
    (1.314, 1.703, 2.052, 2.473, 2.771, 3.421),
    (1.313, 1.701, 2.048, 2.467, 2.763, 3.408),
    (1.311, 1.699, 2.045, 2.462, 2.756, 3.396),
    (1.310, 1.697, 2.042, 2.457, 2.750, 3.385),
    (1.309, 1.696, 2.040, 2.453, 2.744, 3.375),
    (1.309, 1.694, 2.037, 2.449, 2.738, 3.365),
    (1.308, 1.692, 2.035, 2.445, 2.733, 3.356),
    (1.307, 1.691, 2.032, 2.441, 2.728, 3.348),
    (1.306, 1.690, 2.030, 2.438, 2.724, 3.340),
    (1.306, 1.688, 2.028, 2.434, 2.719, 3.333),
    (1.305, 1.687, 2.026, 2.431, 2.715, 3.326),
    (1.304, 1.686, 2.024, 2.429, 2.712, 3.319),
    (1.304, 1.685, 2.023, 2.426, 2.708, 3.313),
    (1.303, 1.684, 2.021, 2.423, 2.704, 3.307),
    (1.303, 1.683, 2.020, 2.421, 2.701, 3.301),
    (1.302, 1.682, 2.018, 2.418, 2.698, 3.296),
    (1.302, 1.681, 2.017, 2.416, 2.695, 3.291),
    (1.301, 1.680, 2.015, 2.414, 2.692, 3.286),
    (1.301, 1.679, 2.014, 2.412, 2.690, 3.281),
    (1.300, 1.679, 2.013, 2.410, 2.687, 3.277),
    (1.300, 1.678, 2.012, 2.408, 2.685, 3.273),
    (1.299, 1.677, 2.011, 2.407, 2.682, 3.269),
    (1.299, 1.677, 2.010, 2.405, 2.680, 3.265),
    (1.299, 1.676, 2.009, 2.403, 2.678, 3.261),
    (1.298, 1.675, 2.008, 2.402, 2.676, 3.258),
    (1.298, 1.675, 2.007, 2.400, 2.674, 3.255),
    (1.298, 1.674, 2.006, 2.399, 2.672, 3.251),
    (1.297, 1.674, 2.005, 2.397, 2.670, 3.248),
    (1.297, 1.673, 2.004, 2.396, 2.668, 3.245),
    (1.297, 1.673, 2.003, 2.395, 2.667, 3.242),
    (1.297, 1.672, 2.002, 2.394, 2.665, 3.239),
    (1.296, 1.672, 2.002, 2.392, 2.663, 3.237),
    (1.296, 1.671, 2.001, 2.391, 2.662, 3.234),
    (1.296, 1.671, 2.000, 2.390, 2.660, 3.232),
    (1.296, 1.670, 2.000, 2.389, 2.659, 3.229),
    (1.295, 1.670, 1.999, 2.388, 2.657, 3.227),
    (1.295, 1.669, 1.998, 2.387, 2.656, 3.225),
    (1.295, 1.669, 1.998, 2.386, 2.655, 3.223),
    (1.295, 1.669, 1.997, 2.385, 2.654, 3.220),
    (1.295, 1.668, 1.997, 2.384, 2.652, 3.218),
    (1.294, 1.668, 1.996, 2.383, 2.651, 3.216),
    (1.294, 1.668, 1.995, 2.382, 2.650, 3.214),
    (1.294, 1.667, 1.995, 2.382, 2.649, 3.213),
    (1.294, 1.667, 1.994, 2.381, 2.648, 3.211),
    (1.294, 1.667, 1.994, 2.380, 2.647, 3.209),
    (1.293, 1.666, 1.993, 2.379, 2.646, 3.207),
    (1.293, 1.666, 1.993, 2.379, 2.645, 3.206),
    (1.293, 1.666, 1.993, 2.378, 2.644, 3.204),
    (1.293, 1.665, 1.992, 2.377, 2.643, 3.202),
    (1.293, 1.665, 1.992, 2.376, 2.642, 3.201),
    (1.293, 1.665, 1.991, 2.376, 2.641, 3.199),
    (1.292, 1.665, 1.991, 2.375, 2.640, 3.198),
    (1.292, 1.664, 1.990, 2.374, 2.640, 3.197),
    (1.292, 1.664, 1.990, 2.374, 2.639, 3.195),
    (1.292, 1.664, 1.990, 2.373, 2.638, 3.194),
    (1.292, 1.664, 1.989, 2.373, 2.637, 3.193),
    (1.292, 1.663, 1.989, 2.372, 2.636, 3.191),
    (1.292, 1.663, 1.989, 2.372, 2.636, 3.190),
    (1.292, 1.663, 1.988, 2.371, 2.635, 3.189),
    (1.291, 1.663, 1.988, 2.370, 2.634, 3.188),
    (1.291, 1.663, 1.988, 2.370, 2.634, 3.187),
    (1.291, 1.662, 1.987, 2.369, 2.633, 3.185),
    (1.291, 1.662, 1.987, 2.369, 2.632, 3.184),
    (1.291, 1.662, 1.987, 2.368, 2.632, 3.183),
    (1.291, 1.662, 1.986, 2.368, 2.631, 3.182),
    (1.291, 1.662, 1.986, 2.368, 2.630, 3.181),
    (1.291, 1.661, 1.986, 2.367, 2.630, 3.180),
    (1.291, 1.661, 1.986, 2.367, 2.629, 3.179),
    (1.291, 1.661, 1.985, 2.366, 2.629, 3.178),
    (1.290, 1.661, 1.985, 2.366, 2.628, 3.177),
    (1.290, 1.661, 1.985, 2.365, 2.627, 3.176),
    (1.290, 1.661, 1.984, 2.365, 2.627, 3.175),
    (1.290, 1.660, 1.984, 2.365, 2.626, 3.175),
    (1.290, 1.660, 1.984, 2.364, 2.626, 3.174),
]

# --------------------------------------------------------------------------- compare

def compare(base, other, confidence=99.5, exact=False):
    """ministat's Relative(): OTHER against BASE.

    difference d = mean(other) - mean(base); pooled s = sqrt(((nb-1)vb + (no-1)vo) / df),
    df = nb + no - 2; half-width e = t * s * sqrt(1/nb + 1/no); proven when |d| > e.
    Percentages are of mean(base), the half-width too (e * 100 / mean(base)), as ministat
    20150715 (Debian) prints them."""
    nb, no = len(base), len(other)
    if nb < 2 or no < 2:
        raise SystemExit("stats.py: compare needs at least 2 samples in each file "
                         "(ministat needs 3)")
    df = nb + no - 2
    t = t_two_sided(confidence, df) if exact else t_ministat(confidence, df)
    mb, mo = mean(base), mean(other)
    vb, vo = variance(base), variance(other)
    spool = math.sqrt(((nb - 1) * vb + (no - 1) * vo) / df)
    s = spool * math.sqrt(1.0 / nb + 1.0 / no)
    d = mo - mb
    e = t * s
    res = {"confidence": confidence, "t_source": "exact" if exact else "ministat",
           "df": df, "t": t, "difference": d, "halfwidth": e,
           "percent": d * 100 / mb if mb else None,
           "percent_halfwidth": e * 100 / mb if mb else None,
           "pooled_s": spool, "proven": abs(d) > e,
           "base": describe(base), "other": describe(other)}
    return res


def ministat_lines(res):
    """The lines ministat prints for the comparison (tab-indented, %g)."""
    c = "%.1f" % res["confidence"]
    if not res["proven"]:
        return [f"No difference proven at {c}% confidence"]
    lines = [f"Difference at {c}% confidence",
             "\t%g +/- %g" % (res["difference"], res["halfwidth"])]
    if res["percent"] is not None:
        lines.append("\t%g%% +/- %g%%" % (res["percent"], res["percent_halfwidth"]))
    lines.append("\t(Student's t, pooled s = %g)" % res["pooled_s"])
    return lines


def t_note(res):
    conf, df, t = res["confidence"], res["df"], res["t"]
    if res["t_source"] == "exact":
        return f"# t = {t:.6g}: two-sided {conf:g}% quantile, {df} degrees of freedom (--exact)"
    note = f"# t = {t:.3f}: ministat's table value for {conf:g}%, {df} degrees of freedom"
    if df > MINISTAT_NSTUDENT:
        note += " (its 'inf' row)"
    if float(conf) == 99.5:
        note += (f"; that column is the two-sided 99.8% quantile, the two-sided 99.5% one is "
                 f"{t_two_sided(99.5, df):.3f} (--exact)")
    return note


def cmd_compare(a):
    base, other = read_samples(a.base), read_samples(a.other)
    res = compare(base, other, a.confidence, a.exact)
    if a.json:
        res["base"]["file"], res["other"]["file"] = a.base, a.other
        print(json.dumps(res, indent=1))
        return 0
    print(f"x {a.base}")
    print(f"+ {a.other}")
    print("    N           Min           Max        Median           Avg        Stddev")
    for sym, d in (("x", res["base"]), ("+", res["other"])):
        print("%c %3d %13.8g %13.8g %13.8g %13.8g %13.8g" % (
            sym, d["n"], d["min"], d["max"], d["median"], d["mean"], d["stddev"]))
    print("\n".join(ministat_lines(res)))
    print(t_note(res))
    return 0

# --------------------------------------------------------------------------- results (JSONL)

def load_results(path):
    """Records (lines with "relay" and "workload") and metadata (host/kernel/time/...).

    A line without "relay", or with "type": "header", is a header: its fields are metadata.
    host, kernel and time are also taken from the records when no header gives them, and the
    date from a file name like 2026-11-23-host.jsonl when nothing gives a time."""
    recs, meta = [], {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"stats.py: {path}:{lineno}: not JSON: {e}")
            if obj.get("type") == "header" or "relay" not in obj or "workload" not in obj:
                meta.update({k: v for k, v in obj.items() if k != "type"})
            else:
                recs.append(obj)
    for k in ("host", "kernel", "time", "cpu", "synthetic", "quick"):
        if k not in meta:
            vals = {json.dumps(r[k]) for r in recs if r.get(k) is not None}
            if len(vals) == 1:
                meta[k] = json.loads(vals.pop())
    if "time" not in meta and "date" not in meta:
        m = re.search(r"(\d{4}-\d{2}-\d{2})", os.path.basename(path))
        if m:
            meta["date"] = m.group(1)
    return recs, meta


def meta_line(meta, sep=", "):
    """host, kernel, cpu, time; a warning first for --quick and synthetic files. sep joins the
    warning and the machine line ("\n" for chart titles)."""
    parts = []
    if meta.get("host"):
        parts.append(f"host {meta['host']}")
    if meta.get("kernel"):
        parts.append(f"kernel {meta['kernel']}")
    if meta.get("cpu"):
        parts.append(str(meta["cpu"]))
    if meta.get("time") or meta.get("date"):
        parts.append(str(meta.get("time") or meta.get("date")))
    s = ", ".join(parts)
    warn = []
    if meta.get("synthetic"):
        warn.append("SYNTHETIC DEMO DATA, not measurements")
    if meta.get("quick"):
        warn.append("--quick: a smoke run, not results")
    return sep.join(x for x in ("; ".join(warn), s) if x)


BYTE_RATE = re.compile(r"^([kKMGT]i?)?(B|bit)/s$")


def unit_kind(unit):
    """'rate' (higher is better), 'latency' / 'memory' (lower is better) or None."""
    u = (unit or "").strip()
    if u.endswith("/s"):
        return "rate"
    if u in ("ns", "us", "µs", "ms", "s"):
        return "latency"
    if re.match(r"^([kKMG]i?)?B(/.+)?$", u):
        return "memory"
    return None


def cpu_per_gb(r, suffix=""):
    """Relay CPU seconds per GB (10^9 bytes) moved: relay_cpu_s_per_gb, else
    relay_cpu_s_per_gib converted, else relay_cpu_s / (bytes / 1e9)."""
    v = r.get("relay_cpu_s_per_gb" + suffix)
    if v is not None:
        return float(v)
    v = r.get("relay_cpu_s_per_gib" + suffix)
    if v is not None:
        return float(v) * 1e9 / 2 ** 30
    if not suffix and r.get("relay_cpu_s") is not None and r.get("bytes"):
        return float(r["relay_cpu_s"]) / (float(r["bytes"]) / 1e9)
    return None


PCTS = (("p50", "p50"), ("p99", "p99"), ("p999", "p99.9"))


def percentile(r, key, suffix=""):
    """Latency percentile in µs: field <key>_us (any record), or <key> in a unit-"us" record."""
    v = r.get(f"{key}_us{suffix}")
    if v is None and r.get("unit") in ("us", "µs"):
        v = r.get(key + suffix)
    return None if v is None else float(v)


def metric_value(r, metric):
    if metric == "median":
        v = r.get("median")
        return None if v is None else float(v)
    if metric == "cpu_per_gb":
        return cpu_per_gb(r)
    if metric in ("p50", "p99", "p999"):
        return percentile(r, metric)
    if metric == "cpu_per_conn":
        v = r.get("relay_cpu_us_per_conn")
        return None if v is None else float(v)
    if metric == "system_cpu_per_gb":
        v = r.get("system_cpu_s_per_gb")
        return None if v is None else float(v)
    if metric == "peak_rss":
        v = r.get("peak_rss_kib")
        return None if v is None else float(v)
    raise ValueError(metric)


def metrics_of(r):
    """(metric, label, higher_is_better) rows a record contributes to the ratio table."""
    unit = r.get("unit", "")
    kind = unit_kind(unit)
    out = []
    if kind == "rate":
        out.append(("median", f"{unit} (median)", True))
        if BYTE_RATE.match(unit) and cpu_per_gb(r) is not None:
            out.append(("cpu_per_gb", "relay CPU s/GB", False))
        if BYTE_RATE.match(unit) and r.get("system_cpu_s_per_gb") is not None:
            out.append(("system_cpu_per_gb", "whole-machine CPU s/GB", False))
        if r.get("relay_cpu_us_per_conn") is not None:
            out.append(("cpu_per_conn", "relay CPU µs/conn", False))
    elif kind in ("latency", "memory"):
        out.append(("median", f"{unit} (median)", False))
    if percentile(r, "p99") is not None:
        out.append(("p99", "p99 µs", False))
    return out

# --------------------------------------------------------------------------- ratios

# The issues' targets (ratios in one run), in bench/run's names: workload, param and relay
# globs. "against" matching several relays means the best of them ("HAProxy's best mode"); so
# does "ours" (default: every zcrelay mode). Metrics: median (the workload's unit), cpu_per_gb
# (relay CPU s/GB), system_cpu_per_gb (all CPUs, /proc/stat, s/GB), p99, peak_rss (KiB).
TARGETS = [
    # label, workload, param, metric, against, op, bound[, ours]
    ("bulk, 100 clients, vs HAProxy forced splice", "bulk", "100x*", "median",
     "haproxy-splice", ">=", 1.3),
    ("relay CPU per GB, bulk 100 clients, vs HAProxy forced splice", "bulk", "100x*",
     "cpu_per_gb", "haproxy-splice", "<=", 0.5),
    ("whole-machine CPU per GB, bulk 100 clients, vs HAProxy forced splice", "bulk", "100x*",
     "system_cpu_per_gb", "haproxy-splice", "<=", 0.8),
    ("whole-machine CPU per GB, nc 1 GiB upload, vs HAProxy forced splice", "bulk-nc-upload",
     "1024MiB", "system_cpu_per_gb", "haproxy-splice", "<=", 0.8),
    ("connection rate vs HAProxy's best mode", "connrate", "*", "median", "haproxy-*", ">=",
     1.15),
    ("connection rate vs no relay", "connrate", "*", "median", "direct", ">=", 0.95),
    ("ping-pong, 100 connections, vs HAProxy's best mode", "pingpong", "100conn*", "median",
     "haproxy-*", ">=", 1.25),
    ("ping-pong, 1 connection, p99 vs HAProxy's best mode", "pingpong", "1conn*", "p99",
     "haproxy-*", "<=", 1.0),
    ("copy mode's peak RSS, bulk 100 clients, vs HAProxy's lowest", "bulk", "100x*",
     "peak_rss", "haproxy-*", "<=", 1.0, "zcrelay-copy"),
    ("bulk vs the no-relay ceiling", "bulk", "*", "median", "direct", ">=", 0.8),
    # mode auto against splice mode (the issue "Sockmap mode that earns its name").
    ("mode auto, bulk, vs splice mode", "bulk", "*", "median", "zcrelay-splice", ">=", 0.95,
     "zcrelay-auto"),
    ("mode auto, relay CPU per GB, bulk, vs splice mode", "bulk", "*", "cpu_per_gb",
     "zcrelay-splice", "<=", 1.0, "zcrelay-auto"),
    ("mode auto, nc 1 GiB upload, vs splice mode", "bulk-nc-upload", "1024MiB", "median",
     "zcrelay-splice", ">=", 0.95, "zcrelay-auto"),
    ("mode auto, nc 1 GiB download, vs splice mode", "bulk-nc-download", "1024MiB", "median",
     "zcrelay-splice", ">=", 0.95, "zcrelay-auto"),
    ("mode auto, connection rate, vs splice mode", "connrate", "*", "median", "zcrelay-splice",
     ">=", 0.95, "zcrelay-auto"),
    ("mode auto, ping-pong 1 connection, p50 vs splice mode", "pingpong", "1conn*", "p50",
     "zcrelay-splice", "<=", 0.6, "zcrelay-auto"),
    ("mode auto, ping-pong 100 connections, vs splice mode", "pingpong", "100conn*", "median",
     "zcrelay-splice", ">=", 1.0, "zcrelay-auto"),
]


def split_globs(values):
    out = []
    for v in values or []:
        out += [x for x in v.split(",") if x]
    return out


def pick(recs, glob, metric, higher):
    """Best record among relays matching glob (by metric), or None."""
    cands = [(metric_value(r, metric), r) for r in recs if fnmatch.fnmatchcase(r["relay"], glob)]
    cands = [(v, r) for v, r in cands if v is not None]
    if not cands:
        return None, None
    v, r = (max if higher else min)(cands, key=lambda c: c[0])
    return v, r


def group(recs):
    groups = {}
    for r in recs:
        groups.setdefault((r["workload"], str(r.get("param", "")), r.get("unit", "")), []).append(r)
    return groups


def samples_for(r, samples_dir, results_path):
    """Sample file of a record: its "samples" field (relative to the results file), else
    SAMPLES_DIR/<workload>/<param>/<relay>.txt."""
    cands = []
    if r.get("samples"):
        cands.append(os.path.join(os.path.dirname(results_path), r["samples"]))
    if samples_dir:
        cands.append(os.path.join(samples_dir, r["workload"], str(r.get("param", "")),
                                  r["relay"] + ".txt"))
    for c in cands:
        if os.path.isfile(c):
            return c
    return None


def fmt(v):
    if v is None:
        return "n/a"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}"


def ratio_row(grp, ours_glob, against, metric, label, higher, a, results_path):
    ov, orec = pick(grp, ours_glob, metric, higher)
    tv, trec = pick(grp, against, metric, higher)
    if orec is None or trec is None:
        return None
    row = {"workload": orec["workload"], "param": orec.get("param"), "metric": metric,
           "label": label, "better": "higher" if higher else "lower",
           "ours": orec["relay"], "ours_value": ov, "theirs": trec["relay"], "theirs_value": tv,
           "ratio": ov / tv if tv else None,
           "failures": {orec["relay"]: orec.get("failures", 0), trec["relay"]: trec.get("failures", 0)}}
    if metric == "median" and (a.samples or orec.get("samples")):
        fo = samples_for(orec, a.samples, results_path)
        ft = samples_for(trec, a.samples, results_path)
        if fo and ft:
            xo, xt = read_samples(fo), read_samples(ft)
            if len(xo) >= 2 and len(xt) >= 2:
                c = compare(xt, xo, a.confidence, a.exact)
                row["difference"] = {k: c[k] for k in ("confidence", "t_source", "df", "t",
                                                       "difference", "halfwidth", "percent",
                                                       "percent_halfwidth", "proven")}
    return row


def diff_text(row):
    d = row.get("difference")
    if not d:
        return ""
    if not d["proven"]:
        return f"none proven ({d['confidence']:g}%)"
    if d["percent"] is None:
        return f"{d['difference']:+.4g} ± {d['halfwidth']:.3g}"
    return f"{d['percent']:+.1f}% ± {d['percent_halfwidth']:.1f}%"


def fail_text(row):
    f = {k: v for k, v in row["failures"].items() if v}
    return ", ".join(f"{k}: {v} failed" for k, v in f.items())


def cmd_ratios(a):
    recs, meta = load_results(a.results)
    recs = [r for r in recs if r.get("available", True) is not False]
    groups = group(recs)
    ours_globs = split_globs(a.ours) or ["zcrelay-*"]
    against = split_globs(a.against)
    if not against:   # every other relay, one by one
        seen = []
        for r in recs:
            if not any(fnmatch.fnmatchcase(r["relay"], g) for g in ours_globs) \
                    and r["relay"] not in seen:
                seen.append(r["relay"])
        against = seen
    if a.each:        # each of our relays on its own rather than the best of them
        names = []
        for r in recs:
            if any(fnmatch.fnmatchcase(r["relay"], g) for g in ours_globs) and r["relay"] not in names:
                names.append(r["relay"])
        ours_globs = names
    rows = []
    if a.targets:
        for label, wl, param, metric, vs, op, bound, *own in TARGETS:
            found = False
            for (w, p, u), grp in groups.items():
                if not (fnmatch.fnmatchcase(w, wl) and fnmatch.fnmatchcase(p, param)):
                    continue
                if metric in ("median", "cpu_per_gb", "system_cpu_per_gb") and \
                        unit_kind(u) != "rate":
                    continue
                higher = metric == "median"
                for og in (own or ours_globs):
                    row = ratio_row(grp, og, vs, metric, label, higher, a, a.results)
                    if row is None:
                        continue
                    found = True
                    row["target"] = f"{op} {bound:g}"
                    r = row["ratio"]
                    row["met"] = None if r is None else (r >= bound if op == ">=" else r <= bound)
                    rows.append(row)
            if not found:
                rows.append({"label": label, "workload": wl, "param": param, "metric": metric,
                             "target": f"{op} {bound:g}", "met": None, "missing": True})
    else:
        for (w, p, u), grp in groups.items():
            if a.workload and not any(fnmatch.fnmatchcase(w, g) for g in split_globs(a.workload)):
                continue
            metrics = []
            for r in grp:
                for m in metrics_of(r):
                    if m not in metrics:
                        metrics.append(m)
            for metric, label, higher in metrics:
                for og in ours_globs:
                    for vs in against:
                        row = ratio_row(grp, og, vs, metric, label, higher, a, a.results)
                        if row is not None and row["ours"] != row["theirs"]:
                            rows.append(row)
    if a.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=1))
        return 0
    ml = meta_line(meta)
    if ml:
        print(f"Ratios ours / theirs from {os.path.basename(a.results)}: {ml}\n")
    any_diff = any(r.get("difference") for r in rows)
    if a.targets:
        print("| target | workload | param | ours | theirs | ours / theirs | goal | met |"
              + (" difference |" if any_diff else ""))
        print("|---|---|---|---|---|---|---|---|" + ("---|" if any_diff else ""))
        for r in rows:
            if r.get("missing"):
                print(f"| {r['label']} | {r['workload']} | {r['param']} | no data | | | "
                      f"{r['target']} | n/a |" + (" |" if any_diff else ""))
                continue
            met = {True: "yes", False: "**no**", None: "n/a"}[r["met"]]
            f = fail_text(r)
            print(f"| {r['label']} | {r['workload']} | {r['param']} | {fmt(r['ours_value'])} "
                  f"{r['ours']} | {fmt(r['theirs_value'])} {r['theirs']} | "
                  f"{fmt(r['ratio'])}x | {r['target']} | {met}{' (' + f + ')' if f else ''} |"
                  + (f" {diff_text(r)} |" if any_diff else ""))
    else:
        print("| workload | param | metric | better | ours | theirs | ours / theirs |"
              + (" difference |" if any_diff else "") + " note |")
        print("|---|---|---|---|---|---|---|" + ("---|" if any_diff else "") + "---|")
        for r in rows:
            print(f"| {r['workload']} | {r['param']} | {r['label']} | {r['better']} | "
                  f"{fmt(r['ours_value'])} {r['ours']} | {fmt(r['theirs_value'])} {r['theirs']} | "
                  f"{fmt(r['ratio'])}x |" + (f" {diff_text(r)} |" if any_diff else "")
                  + f" {fail_text(r)} |")
    if any_diff:
        d = next(r["difference"] for r in rows if r.get("difference"))
        print(f"\ndifference: mean of ours minus mean of theirs, in % of theirs, Student's t at "
              f"{d['confidence']:g}% " + ("(exact quantile)" if d["t_source"] == "exact"
                                           else "(ministat's table)") + ".")
    return 0

# --------------------------------------------------------------------------- plotdata

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#ad494a", "#637939", "#843c39"]


def gp_str(s):
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def dat_str(s):
    return '"' + str(s).replace('"', "'") + '"'


def dat_num(v):
    return "NaN" if v is None else repr(float(v))


def slug(s):
    return re.sub(r"[^A-Za-z0-9]+", "_", s).strip("_") or "x"


def write_chart(outdir, name, clusters, series, colors, values, title, xlabel, ylabel, logy,
                png):
    """values[(cluster, series)] = (y, lo, hi). One data row per cluster, 3 columns a series."""
    dat = os.path.join(outdir, name + ".dat")
    with open(dat, "w", encoding="utf-8") as f:
        f.write("group " + " ".join(f"{dat_str(s)} lo hi" for s in series) + "\n")
        for c in clusters:
            cols = []
            for s in series:
                y, lo, hi = values.get((c, s), (None, None, None))
                cols += [dat_num(y), dat_num(lo if lo is not None else y),
                         dat_num(hi if hi is not None else y)]
            f.write(dat_str(c) + " " + " ".join(cols) + "\n")
    width = int(min(2400, max(1100, 7 * max(map(len, title.split("\n"))) + 200,
                              260 + len(clusters) * (len(series) + 1.5) * 13)))
    gp = os.path.join(outdir, name + ".vars.gp")
    with open(gp, "w", encoding="utf-8") as f:
        f.write(f"datafile = {gp_str(dat)}\noutfile = {gp_str(png)}\n"
                f"nseries = {len(series)}\ncolors = {gp_str(' '.join(colors))}\n"
                f"charttitle = {gp_str(title)}\nxlab = {gp_str(xlabel)}\n"
                f"ylab = {gp_str(ylabel)}\nlogy = {1 if logy else 0}\nwidth = {width}\n")
    return gp


def cmd_plotdata(a):
    """Writes <name>.dat and <name>.vars.gp per chart into OUTDIR and prints one line per
    chart: the vars file, a tab, the PNG it makes. Notes on skipped charts go to stderr."""
    recs, meta = load_results(a.results)
    recs = [r for r in recs if r.get("available", True) is not False]
    os.makedirs(a.outdir, exist_ok=True)
    sub = meta_line(meta, "\n")
    relays = []
    for r in recs:
        if r["relay"] not in relays:
            relays.append(r["relay"])
    color = {r: PALETTE[i % len(PALETTE)] for i, r in enumerate(relays)}
    charts = []

    def cluster_of(r):
        return f"{r['workload']} {r.get('param', '')}".strip()

    def bars(name, sel, getter, title, ylabel):
        clusters, series, values = [], [], {}
        for r in sel:
            y, lo, hi = getter(r)
            if y is None:
                continue
            c = cluster_of(r)
            if c not in clusters:
                clusters.append(c)
            if r["relay"] not in series:
                series.append(r["relay"])
            values[(c, r["relay"])] = (y, lo, hi)
        if not clusters:
            return False
        series.sort(key=relays.index)
        gp = write_chart(a.outdir, name, clusters, series, [color[s] for s in series], values,
                         title + ("\n" + sub if sub else ""), "workload, parameter", ylabel,
                         False, os.path.join(a.pngdir or a.outdir, name + ".png"))
        charts.append((gp, os.path.join(a.pngdir or a.outdir, name + ".png")))
        return True

    def med(r):
        f = lambda k: None if r.get(k) is None else float(r[k])
        return f("median"), f("min"), f("max")

    # (a) throughput, one chart per byte-rate unit; other rates (conn/s, req/s) likewise.
    units = []
    for r in recs:
        if unit_kind(r.get("unit")) == "rate" and r["unit"] not in units:
            units.append(r["unit"])
    for u in units:
        sel = [r for r in recs if r.get("unit") == u]
        if BYTE_RATE.match(u):
            name = "throughput" if u == "MB/s" else "throughput-" + slug(u)
            what = "Throughput"
            ylabel = f"{u}" + (" (10^6 bytes/s)" if u == "MB/s" else "") + ", median of runs"
        else:
            name = "rate-" + slug(u)
            what = "Rate"
            ylabel = f"{u}, median of runs"
        bars(name, sel, med, f"{what} per relay (bar: median; error bar: min to max over runs)",
             ylabel)
    if not any(BYTE_RATE.match(u) for u in units):
        print("plot: no throughput records (unit MB/s or another byte rate)", file=sys.stderr)

    # (b) relay CPU seconds per GB.
    def cpu(r):
        y = cpu_per_gb(r)
        return y, cpu_per_gb(r, "_min"), cpu_per_gb(r, "_max")
    sel = [r for r in recs if BYTE_RATE.match(r.get("unit", ""))]
    if not bars("cpu-per-gb", sel, cpu,
                "Relay CPU per GB moved (user+sys of the relay's process tree; lower is better)",
                "relay CPU seconds per GB (10^9 bytes)"):
        print("plot: no records with relay CPU per GB (relay_cpu_s_per_gb, relay_cpu_s_per_gib "
              "or relay_cpu_s + bytes)", file=sys.stderr)

    # (c) latency percentiles, one chart per workload/param that has them.
    lat = {}
    for r in recs:
        if any(percentile(r, k) is not None for k, _ in PCTS):
            lat.setdefault(cluster_of(r), []).append(r)
    if not lat:
        print("plot: no latency records (fields p50_us/p99_us/p999_us, or p50/p99/p999 with "
              "unit us)", file=sys.stderr)
    for c, sel in lat.items():
        clusters = [r["relay"] for r in sel]
        series = [lbl for k, lbl in PCTS if any(percentile(r, k) is not None for r in sel)]
        values = {}
        for r in sel:
            for k, lbl in PCTS:
                values[(r["relay"], lbl)] = (percentile(r, k), percentile(r, k, "_min"),
                                             percentile(r, k, "_max"))
        name = "latency-" + slug(c)
        png = os.path.join(a.pngdir or a.outdir, name + ".png")
        gp = write_chart(a.outdir, name, clusters, series,
                         ["#4c72b0", "#dd8452", "#c44e52"][:len(series)], values,
                         f"Round-trip latency, {c}: p50 / p99 / p99.9 (median of runs; "
                         f"error bar: min to max where recorded)" + ("\n" + sub if sub else ""),
                         "relay", "round-trip latency (µs), log scale", True, png)
        charts.append((gp, png))
    for gp, png in charts:
        print(f"{gp}\t{png}")
    return 0

# --------------------------------------------------------------------------- selftest

def ministat_run(binary, conf, fa, fb):
    out = subprocess.run([binary, "-A", "-c", "%g" % conf, fa, fb], capture_output=True,
                         text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"ministat failed: {out.stderr.strip()}")
    lines = out.stdout.splitlines()
    for i, l in enumerate(lines):
        if l.startswith("Difference at") or l.startswith("No difference"):
            return lines[i:]
    raise RuntimeError("no comparison in ministat's output:\n" + out.stdout)


def cmd_selftest(a):
    bad = 0

    def check(ok, msg):
        nonlocal bad
        if not ok:
            bad += 1
            print("FAIL " + msg)
        elif a.verbose:
            print("ok   " + msg)

    # 1. closed forms and symmetry.
    for p in (0.6, 0.9, 0.95, 0.975, 0.99, 0.995, 0.9975, 0.999, 0.9995):
        for df, exact in ((1, math.tan(math.pi * (p - 0.5))),
                          (2, (2 * p - 1) / math.sqrt(2 * p * (1 - p)))):
            # the general (Newton + incomplete beta) path, not the closed-form shortcut
            got = _solve_general(p, df)
            check(abs(got - exact) <= 1e-9 * exact, f"t_ppf({p}, {df}) = {got!r} vs {exact!r}")
        # df = 4: P(T > t) = 1/2 - (3/4) u (1 - u^2/3), u = t / sqrt(4 + t^2)
        t4 = t_ppf(p, 4)
        u = t4 / math.sqrt(4 + t4 * t4)
        check(abs(0.5 - 0.75 * u * (1 - u * u / 3) - (1 - p)) < 1e-13, f"t_ppf({p}, 4) = {t4!r}")
        z = statistics.NormalDist().inv_cdf(p)
        check(abs(t_ppf(p, 1e6) - z) < 1e-4 * z, f"t_ppf({p}, 1e6) close to the normal {z}")
        check(t_ppf(1 - p, 7) == -t_ppf(p, 7), f"symmetry at {p}")
    # Round trip through the CDF at awkward df.
    for df in (3, 5.5, 17, 100, 1000, 50000):
        for p in (0.9, 0.999, 0.99999):
            t = t_ppf(p, df)
            check(abs(t_sf(t, df) - (1 - p)) < 1e-12 * (1 - p) * 1e3,
                  f"sf(ppf({p}, {df})) = {1 - t_sf(t, df)!r}")

    # 2. Our quantile against an independent CDF (closed-form series, integer df), and
    #    ministat's table against our quantile rounded to 3 decimals.
    for df in range(1, 31):
        for p in MINISTAT_LEVELS.values():
            t = t_ppf(p, df)
            got = t_sf_series(t, df)
            check(abs(got - (1 - p)) < 1e-9 * (1 - p),
                  f"series P(T > t_ppf({p}, {df})) = {got!r}, want {1 - p!r}")
    mism = []
    for df, row in enumerate(MINISTAT_TABLE):
        for conf, val in zip(MINISTAT_LEVELS, row):
            mine = t_ppf(MINISTAT_LEVELS[conf], df if df else math.inf)
            if round(mine, 3) != val:
                mism.append((df, conf, val, mine))
            # The table must at least be close: a wrong column or level would be far off.
            check(abs(mine - val) < 0.005, f"table df {df}, {conf:g}%: {val} vs {mine:.6f}")
    cells = len(MINISTAT_TABLE) * len(MINISTAT_LEVELS)
    print(f"ministat's table: {cells - len(mism)} of {cells} cells equal our quantile rounded to "
          f"3 decimals; the others are errors of the table:")
    for df, conf, val, mine in mism:
        p = MINISTAT_LEVELS[conf]
        sf_tab = t_sf_series(val, df) if df else None
        print(f"  df {df or 'inf'}, {conf:g}%: table {val}, exact {mine:.6f} "
              f"(P(T > {val}) = {sf_tab:.6g} by the series, want {1 - p:g})")
    c995 = MINISTAT_TABLE[20][5]
    print(f"ministat's 99.5% column at df 20: {c995} = t_0.999 = {t_ppf(0.999, 20):.4f} "
          f"(two-sided 99.8%); the two-sided 99.5% quantile is t_0.9975 = "
          f"{t_ppf(0.9975, 20):.4f}")

    # 3. the ministat binary: the t it really applies, and whole comparisons on sample files.
    if a.ministat:
        binary = a.ministat_path
        with tempfile.TemporaryDirectory() as tmp:
            fa, fb = os.path.join(tmp, "a"), os.path.join(tmp, "b")
            wrong = 0
            runs = 0
            for df in list(range(4, MINISTAT_NSTUDENT + 1)) + [101, 150]:
                na = (df + 2) // 2
                nb = df + 2 - na
                xa = [float(i % 3) for i in range(na)]
                xb = [1000.0 + (i % 3) for i in range(nb)]
                with open(fa, "w") as f:
                    f.write("\n".join(map(str, xa)) + "\n")
                with open(fb, "w") as f:
                    f.write("\n".join(map(str, xb)) + "\n")
                spool = math.sqrt(((na - 1) * variance(xa) + (nb - 1) * variance(xb)) / df)
                s = spool * math.sqrt(1 / na + 1 / nb)
                for conf in MINISTAT_LEVELS:
                    lines = ministat_run(binary, conf, fa, fb)
                    e = float(lines[1].split("+/-")[1])
                    t_bin = round(e / s, 3)
                    runs += 1
                    if abs(t_bin - t_ministat(conf, df)) > 1e-9:
                        wrong += 1
                        print(f"FAIL ministat uses t = {t_bin} at df {df}, {conf:g}%; "
                              f"we use {t_ministat(conf, df)}")
            bad += wrong
            print(f"ministat binary: the t it applies equals ours in {runs - wrong} of {runs} "
                  f"(df 4-100, 101, 150 x 6 levels)")
        for d in a.samples or []:
            n_pairs = n_same = n_proven = 0
            for root, _, files in sorted(os.walk(d)):
                files = sorted(f for f in files if not f.startswith("."))
                for fb_ in files:
                    for fo_ in files:
                        if fb_ == fo_:
                            continue
                        pb, po = os.path.join(root, fb_), os.path.join(root, fo_)
                        xb, xo = read_samples(pb), read_samples(po)
                        if len(xb) < 3 or len(xo) < 3:
                            continue
                        for conf in (95, 99.5):
                            ours = ministat_lines(compare(xb, xo, conf))
                            theirs = ministat_run(binary, conf, pb, po)
                            n_pairs += 1
                            n_proven += ours[0].startswith("Difference")
                            if ours == theirs[:len(ours)]:
                                n_same += 1
                            else:
                                bad += 1
                                print(f"FAIL {pb} vs {po} at {conf}%:\n  ours:     {ours}\n"
                                      f"  ministat: {theirs}")
            print(f"compare vs ministat on {d}: {n_same} of {n_pairs} comparisons print the same "
                  f"lines ({n_proven} differences proven, {n_pairs - n_proven} not)")
    print("selftest: " + ("ok" if not bad else f"{bad} FAILED"))
    return 1 if bad else 0


# --------------------------------------------------------------------------- main

def cmd_summarize(a):
    for path in a.files:
        d = {k: tidy(v) for k, v in describe(read_samples(path)).items()}
        if len(a.files) > 1 or a.with_file:
            d["file"] = path
        print(json.dumps(d))
    return 0


def cmd_median(a):
    xs = read_samples(a.file)
    print(json.dumps(tidy(statistics.median(xs)) if xs else None))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="stats.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("summarize", help="statistics of sample files as JSON",
                       description="Prints {median, min, max, mean, stddev, n} of each sample "
                       "file as one JSON object per line (stddev: sample, n - 1; null for n < 2; "
                       "all null and n 0 for an empty file). With several files each object "
                       "also has \"file\".")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--with-file", action="store_true", help="add \"file\" for one file too")
    p.set_defaults(fn=cmd_summarize)

    p = sub.add_parser("median", help="median of one sample file",
                       description="Prints the median of FILE as a JSON number (null if empty).")
    p.add_argument("file", metavar="FILE")
    p.set_defaults(fn=cmd_median)

    p = sub.add_parser("compare", help="ministat's Student's t comparison of OTHER against BASE",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="""\
Compares OTHER against BASE as `ministat -c C BASE OTHER` does: the summary table, then the
difference of the means (OTHER - BASE) with a Student's t confidence interval using the pooled
standard deviation, absolute and in % of BASE's mean, or "No difference proven at C%
confidence" when the interval includes 0. The last line (starting with #) says which t was used.

By default t is ministat's table value (3 decimals, its 'inf' row beyond 100 degrees of freedom),
so the lines match ministat's; ministat's "99.5%" column is the two-sided 99.8% quantile.
--exact uses the true two-sided quantile at the stated level (any level).""")
    p.add_argument("base", metavar="BASE.txt")
    p.add_argument("other", metavar="OTHER.txt")
    p.add_argument("-c", "--confidence", type=float, default=99.5,
                   help="confidence level in %% (default 99.5; without --exact one of "
                   "80 90 95 98 99 99.5)")
    p.add_argument("--exact", action="store_true",
                   help="true two-sided quantile instead of ministat's table value")
    p.add_argument("--json", action="store_true", help="JSON instead of ministat's layout")
    p.set_defaults(fn=cmd_compare)

    p = sub.add_parser("ratios", help="ours / theirs ratio table, and the issue's targets",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=f"""\
Prints a Markdown table of ours / theirs per workload and parameter of RESULTS.jsonl, for each
metric a record has:
  rate units (MB/s, conn/s, req/s: anything ending in /s)  median       higher is better
  byte rates (MB/s ...) with relay CPU                      CPU s per GB lower is better
  latency (us, ms) and memory (B/conn, KiB) units           median       lower is better
  records with p99_us (or p99 with unit us)                 p99          lower is better
CPU per GB (10^9 bytes) is relay_cpu_s_per_gb, else relay_cpu_s_per_gib converted, else
relay_cpu_s / (bytes / 1e9).

--ours and --against take relay names or globs (comma-separated or repeated). A glob matching
several relays stands for the best of them for that metric (so --against 'haproxy-*' is
HAProxy's best mode); the table names the relay that was best. --ours defaults to
'zcrelay-*', i.e. zcrelay's best mode per workload and metric; --each lists each of our
relays instead. --against defaults to every other relay, one by one.

--targets prints the issue's targets instead, each with its goal and whether it is met:
""" + "\n".join(f"  {t[0]}: {t[1]} {t[2]}, {t[3]} vs {t[4]} {t[5]} {t[6]}" for t in TARGETS) + """

A record's "samples" field (its sample file, relative to RESULTS.jsonl) or --samples DIR
(DIR/<workload>/<param>/<relay>.txt) adds a "difference" column to median rows: the ministat
comparison of our samples against theirs (Student's t at --confidence, default 99.5; see
compare --help).""")
    p.add_argument("results", metavar="RESULTS.jsonl")
    p.add_argument("--ours", action="append", metavar="GLOB", help="our relays (zcrelay-*)")
    p.add_argument("--against", action="append", metavar="GLOB",
                   help="relays to compare with (default: every other relay)")
    p.add_argument("--each", action="store_true", help="every one of our relays, not the best")
    p.add_argument("--workload", action="append", metavar="GLOB", help="only these workloads")
    p.add_argument("--targets", action="store_true", help="the issue's targets")
    p.add_argument("--samples", metavar="DIR", help="sample files, for the t-test column")
    p.add_argument("-c", "--confidence", type=float, default=99.5)
    p.add_argument("--exact", action="store_true", help="exact t quantile (see compare --help)")
    p.add_argument("--json", action="store_true", help="JSON instead of Markdown")
    p.set_defaults(fn=cmd_ratios)

    p = sub.add_parser("plotdata", help="data files for bench/plot.sh",
                       description="Writes gnuplot data and settings for the charts bench/plot.sh "
                       "draws into OUTDIR; prints 'VARS.gp<TAB>PNG' per chart.")
    p.add_argument("results", metavar="RESULTS.jsonl")
    p.add_argument("outdir", metavar="OUTDIR")
    p.add_argument("--pngdir", metavar="DIR", help="where the PNGs go (default OUTDIR)")
    p.set_defaults(fn=cmd_plotdata)

    p = sub.add_parser("selftest", help="check the t quantiles (and ministat agreement)",
                       description="Checks t_ppf against closed forms (df 1, 2, 4), the normal "
                       "limit and its own CDF, and against every cell of ministat's table. "
                       "With --ministat also against the ministat binary: the t it applies for "
                       "df 4-100 and beyond, and, for every ordered pair of sample files in each "
                       "directory under the given DIRs, the printed comparison at 95%% and 99.5%%.")
    p.add_argument("samples", nargs="*", metavar="DIR", help="sample directories (with --ministat)")
    p.add_argument("--ministat", action="store_true", help="compare with the ministat binary")
    p.add_argument("--ministat-path", default="ministat")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(fn=cmd_selftest)

    a = ap.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:          # e.g. piped into head
        sys.stderr.close()
        sys.exit(1)

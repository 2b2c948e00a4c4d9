"""The look shared by every benchmark plot (matplotlib, optional).

- one colour and one marker per series: no two series of an axes share either
  (:func:`series_styles`);
- the legend outside the axes (:func:`legend_outside`), so no entry hides data;
- log axes where the values span decades (:func:`log_axes`, :func:`spans_decades`);
- every figure saved as SVG (for the docs) beside PNG and PDF (:func:`save`).

Nothing here imports matplotlib at module level: the helpers take the axes or figure
that the caller made after importing it.
"""

from __future__ import annotations

from pathlib import Path

# Qualitative colours told apart by hue (matplotlib's tab10), then darker ones of other
# hues for axes with more series; no two are shades of one colour.
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939", "#843c39", "#7b4173",
           "#e7ba52", "#000000")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "*", "p", "d", "H", "8", "1")
# reference lines (floors, goals) are drawn in these, apart from the series
REFERENCE = "#000000"


def series_styles(names) -> dict[str, dict]:
    """Matplotlib keywords (``color``, ``marker``) for each distinct name, in order: the
    i-th name gets the i-th colour and the i-th marker, so up to 16 series no two share
    a colour or a marker."""
    names = list(dict.fromkeys(names))
    if len(names) > min(len(COLOURS), len(MARKERS)):
        raise ValueError(f"{len(names)} series in one axes: at most "
                         f"{min(len(COLOURS), len(MARKERS))} stay distinguishable; split them")
    return {name: {"color": COLOURS[i], "marker": MARKERS[i]} for i, name in enumerate(names)}


def spans_decades(values, decades: float = 1.5) -> bool:
    """Whether the positive values span more than ``decades`` powers of ten (a log axis
    shows them; a linear one flattens the small ones)."""
    positive = [float(v) for v in values if v is not None and float(v) > 0]
    return len(positive) >= 2 and max(positive) / min(positive) > 10 ** decades


def log_axes(ax, x: bool = True, y: bool = True, x_base: int = 10) -> None:
    """Log scales with plain tick labels (4, 8, 16 / 10, 100, 1000) and no minor labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    if x:
        ax.set_xscale("log", base=x_base)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    if y:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, numticks=12))
        ax.yaxis.set_minor_formatter(NullFormatter())


def legend_outside(ax, extra=(), title: str | None = None) -> None:
    """The legend right of the axes (``extra``: (handle, text) pairs added at its end);
    the figure grows taller when the entries would not fit beside the axes."""
    handles, labels = ax.get_legend_handles_labels()
    handles, labels = handles + [h for h, _ in extra], labels + [t for _, t in extra]
    if not labels:
        return
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0),
              borderaxespad=0.0, fontsize=7, frameon=False, title=title,
              title_fontsize=7)
    fig = ax.figure
    needed = 0.16 * len(labels) + 0.9          # inches: 7-point entries and the margins
    width, height = fig.get_size_inches()
    if needed > height:
        fig.set_size_inches(width, needed)


def save(fig, path, formats=(".svg", ".png", ".pdf")) -> list[str]:
    """Save ``fig`` as ``path`` with each suffix (SVG first: what the docs show), the
    legends outside the axes kept by ``bbox_inches="tight"``; close it; return the
    files written."""
    import matplotlib.pyplot as plt
    path = Path(path)
    written = []
    for suffix in formats:
        out = path.with_suffix(suffix)
        fig.savefig(out, bbox_inches="tight", **({"dpi": 110} if suffix == ".png" else {}))
        written.append(str(out))
    plt.close(fig)
    return written

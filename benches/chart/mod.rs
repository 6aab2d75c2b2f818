//! The throughput bench's chart: rows/s of each configuration beside the raw limit it is compared
//! with, as an SVG a browser or GitHub shows as it is (no plotting crate: a chart of bars is a few
//! rectangles and lines of text).

use std::fmt::Write;

/// One configuration's bar: dbtrigger's median rows/s and the median of the raw limit it was
/// compared with (the same engine, batch size and window), and the median of its ratios.
pub struct Bar {
    /// The group the bar is drawn in: `SQLite, batch 100`.
    pub group: String,
    /// The configuration: `file state, maxInFlight 4`.
    pub label: String,
    pub rows_per_second: f64,
    pub limit_rows_per_second: f64,
    pub ratio: f64,
}

const WIDTH: f64 = 920.0;
const LABEL_WIDTH: f64 = 300.0;
const RATIO_WIDTH: f64 = 70.0;
const ROW_HEIGHT: f64 = 24.0;
const GROUP_GAP: f64 = 26.0;
const TOP: f64 = 84.0;
const AXIS_HEIGHT: f64 = 36.0;
const LIMIT_COLOUR: &str = "#c9ced6";
const DBTRIGGER_COLOUR: &str = "#2f6fb3";

/// The chart of `bars` (in their order, a group starting where its name changes), titled `title`
/// with `caption` (when, where, how) under it.
pub fn svg(title: &str, caption: &str, bars: &[Bar]) -> String {
    let groups = bars.windows(2).filter(|pair| pair[0].group != pair[1].group).count() + usize::from(!bars.is_empty());
    let height = TOP + groups as f64 * GROUP_GAP + bars.len() as f64 * ROW_HEIGHT + AXIS_HEIGHT + 16.0;
    let plot_left = LABEL_WIDTH;
    let plot_width = WIDTH - LABEL_WIDTH - RATIO_WIDTH - 10.0;
    let highest = bars.iter().flat_map(|bar| [bar.rows_per_second, bar.limit_rows_per_second]).fold(0.0, f64::max);
    let step = tick_step(highest);
    let top_of_axis = if highest > 0.0 { (highest / step).ceil() * step } else { 1.0 };
    let x = |value: f64| plot_left + plot_width * (value / top_of_axis).clamp(0.0, 1.0);

    let mut out = String::new();
    let _ = writeln!(
        out,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="Helvetica, Arial, sans-serif" font-size="12">"##
    );
    let _ = writeln!(out, r##"<rect width="{WIDTH}" height="{height}" fill="white"/>"##);
    let _ = writeln!(out, r##"<text x="10" y="22" font-size="15" font-weight="bold">{}</text>"##, escape(title));
    let _ = writeln!(out, r##"<text x="10" y="40" fill="#555">{}</text>"##, escape(caption));
    // The legend.
    let _ = writeln!(out, r##"<rect x="10" y="52" width="14" height="12" fill="{LIMIT_COLOUR}"/>"##);
    let _ = writeln!(out, r##"<text x="30" y="62">raw limit, same run, same window</text>"##);
    let _ = writeln!(out, r##"<rect x="250" y="55" width="14" height="6" fill="{DBTRIGGER_COLOUR}"/>"##);
    let _ = writeln!(out, r##"<text x="270" y="62">dbtrigger</text>"##);
    let _ = writeln!(out, r##"<text x="{}" y="62" text-anchor="end">ratio (median)</text>"##, WIDTH - 10.0);

    let plot_top = TOP - 8.0;
    let plot_bottom = height - AXIS_HEIGHT - 8.0;
    // Grid lines and the axis' labels.
    let mut tick = 0.0;
    while tick <= top_of_axis + step / 2.0 {
        let at = x(tick);
        let _ = writeln!(
            out,
            r##"<line x1="{at:.1}" y1="{plot_top:.1}" x2="{at:.1}" y2="{plot_bottom:.1}" stroke="#e4e4e4"/>"##
        );
        let _ = writeln!(
            out,
            r##"<text x="{at:.1}" y="{:.1}" text-anchor="middle" fill="#555">{}</text>"##,
            plot_bottom + 16.0,
            thousands(tick)
        );
        tick += step;
    }
    let _ = writeln!(
        out,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#555">rows/s</text>"##,
        plot_left + plot_width / 2.0,
        plot_bottom + 32.0
    );

    let mut y = TOP;
    let mut group: Option<&str> = None;
    for bar in bars {
        if group != Some(bar.group.as_str()) {
            group = Some(bar.group.as_str());
            y += GROUP_GAP;
            let _ =
                writeln!(out, r##"<text x="10" y="{:.1}" font-weight="bold">{}</text>"##, y - 8.0, escape(&bar.group));
        }
        let middle = y + ROW_HEIGHT / 2.0;
        let _ = writeln!(out, r##"<text x="20" y="{:.1}">{}</text>"##, middle + 4.0, escape(&bar.label));
        let _ = writeln!(
            out,
            r##"<rect x="{plot_left:.1}" y="{:.1}" width="{:.1}" height="18" fill="{LIMIT_COLOUR}"><title>raw limit: {} rows/s</title></rect>"##,
            middle - 9.0,
            x(bar.limit_rows_per_second) - plot_left,
            thousands(bar.limit_rows_per_second)
        );
        let _ = writeln!(
            out,
            r##"<rect x="{plot_left:.1}" y="{:.1}" width="{:.1}" height="8" fill="{DBTRIGGER_COLOUR}"><title>dbtrigger: {} rows/s</title></rect>"##,
            middle - 4.0,
            x(bar.rows_per_second) - plot_left,
            thousands(bar.rows_per_second)
        );
        let _ = writeln!(
            out,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="end">{:.2}</text>"##,
            WIDTH - 10.0,
            middle + 4.0,
            bar.ratio
        );
        y += ROW_HEIGHT;
    }
    out.push_str("</svg>\n");
    out
}

/// A round step for the axis: 1, 2 or 5 times a power of ten, about six steps up to `highest`.
fn tick_step(highest: f64) -> f64 {
    if highest <= 0.0 {
        return 1.0;
    }
    let rough = highest / 6.0;
    let power = 10f64.powf(rough.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|factor| factor * power).find(|step| *step >= rough).unwrap_or(10.0 * power)
}

/// `1234567.8` as `1,234,568`.
fn thousands(value: f64) -> String {
    let digits = format!("{:.0}", value.max(0.0));
    let mut out = String::new();
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index) % 3 == 0 {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

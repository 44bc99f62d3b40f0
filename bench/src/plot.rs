//! A replay report as an SVG: TTFT CDF per policy (log time axis) and reuse per policy.

use std::fmt::Write;

use crate::replay::Report;

const COLORS: [&str; 6] = [
    "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
];

/// The SVG document.
pub fn svg(report: &Report) -> String {
    let (w, h, pad) = (960.0, 420.0, 50.0);
    let cdf_w = 560.0;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let all = report
        .policies
        .iter()
        .flat_map(|p| p.ttft_sorted_ms.iter().copied());
    let (lo, hi) = all.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
        (lo.min(v.max(0.1)), hi.max(v))
    });
    let (lo, hi) = if lo.is_finite() && hi > lo {
        (lo.log10(), hi.log10())
    } else {
        (0.0, 1.0)
    };
    let x = |v: f64| pad + (v.max(0.1).log10() - lo) / (hi - lo) * (cdf_w - 2.0 * pad);
    let y = |q: f64| h - pad - q * (h - 2.0 * pad);
    let _ = writeln!(
        out,
        r#"<text x="{pad}" y="24" font-size="14">TTFT CDF ({} workers, speedup {})</text>"#,
        report.workers, report.speedup
    );
    let _ = writeln!(
        out,
        r#"<line x1="{pad}" y1="{}" x2="{}" y2="{}" stroke="black"/>"#,
        y(0.0),
        cdf_w - pad,
        y(0.0)
    );
    let _ = writeln!(
        out,
        r#"<line x1="{pad}" y1="{}" x2="{pad}" y2="{}" stroke="black"/>"#,
        y(0.0),
        y(1.0)
    );
    for decade in (lo.floor() as i32)..=(hi.ceil() as i32) {
        let v = 10f64.powi(decade);
        if (lo..=hi).contains(&v.log10()) {
            let _ = writeln!(
                out,
                r#"<text x="{:.1}" y="{}" text-anchor="middle">{v} ms</text>"#,
                x(v),
                y(0.0) + 16.0
            );
        }
    }
    for (i, p) in report.policies.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let n = p.ttft_sorted_ms.len().max(1) as f64;
        let step = (p.ttft_sorted_ms.len() / 400).max(1);
        let points: Vec<String> = p
            .ttft_sorted_ms
            .iter()
            .enumerate()
            .filter(|(k, _)| k % step == 0 || *k + 1 == p.ttft_sorted_ms.len())
            .map(|(k, v)| format!("{:.1},{:.1}", x(*v), y((k + 1) as f64 / n)))
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
            points.join(" ")
        );
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" fill="{color}">{}</text>"#,
            pad + 10.0,
            pad + 16.0 * i as f64,
            p.policy
        );
    }
    // Reuse bars, with the infinite-cache bound as a line.
    let bx = cdf_w + pad;
    let bw = (w - bx - pad) / report.policies.len().max(1) as f64;
    let _ = writeln!(
        out,
        r#"<text x="{bx}" y="24" font-size="14">prefix reuse (bound {:.3})</text>"#,
        report.bound_reuse_ratio
    );
    for (i, p) in report.policies.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let top = y(p.reuse_ratio);
        let _ = writeln!(
            out,
            r#"<rect x="{:.1}" y="{top:.1}" width="{:.1}" height="{:.1}" fill="{color}"/>"#,
            bx + i as f64 * bw + 4.0,
            bw - 8.0,
            y(0.0) - top
        );
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{:.2}</text>"#,
            bx + (i as f64 + 0.5) * bw,
            top - 4.0,
            p.reuse_ratio
        );
    }
    let by = y(report.bound_reuse_ratio);
    let _ = writeln!(
        out,
        r#"<line x1="{bx}" y1="{by:.1}" x2="{}" y2="{by:.1}" stroke="black" stroke-dasharray="4"/>"#,
        w - pad
    );
    out.push_str("</svg>\n");
    out
}

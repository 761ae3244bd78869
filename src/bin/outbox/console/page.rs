//! The console's HTML: escaping, the page frame, and the small text helpers its pages share.
//! Every piece of data (topics, keys, payloads, headers, errors, relay names) is untrusted
//! and goes through [`esc`] or [`url`] before it is written into a page.

use std::fmt::Write;

/// `text` safe inside HTML text and inside a double- or single-quoted attribute.
pub fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `text` percent-encoded for one component of a URL's query (`?relay=…&key=…`).
pub fn url(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// The pairs of a query string or of an `application/x-www-form-urlencoded` body, decoded,
/// in order (a name may come several times, as `id` does).
pub fn pairs(text: &str) -> Vec<(String, String)> {
    text.split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            (decode(name), decode(value))
        })
        .collect()
}

/// Undoes the form encoding: `+` is a space, `%XX` a byte; a malformed escape stays as is.
fn decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                match std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                {
                    Some(byte) => {
                        out.push(byte);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The first value of `name` among `pairs`, if set and not blank.
pub fn value<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(n, v)| n == name && !v.trim().is_empty())
        .map(|(_, v)| v.as_str())
}

/// How long ago, for people: `4.2s`, `3m 12s`, `5h 2m`, `3d 4h`.
pub fn age(seconds: f64) -> String {
    let s = seconds.max(0.0);
    if s < 60.0 {
        return format!("{s:.1}s");
    }
    let whole = s as u64;
    match whole {
        0..3600 => format!("{}m {}s", whole / 60, whole % 60),
        3600..86400 => format!("{}h {}m", whole / 3600, whole % 3600 / 60),
        _ => format!("{}d {}h", whole / 86400, whole % 86400 / 3600),
    }
}

/// A duration in seconds for people: `850 ms`, `2.40 s`.
pub fn seconds(s: f64) -> String {
    if s < 1.0 {
        format!("{:.0} ms", s * 1000.0)
    } else {
        format!("{s:.2} s")
    }
}

/// A small line chart of `values` (oldest first; `None` is a gap), scaled to its largest,
/// as inline SVG: no script, nothing fetched. `label` says what it shows.
pub fn chart(values: &[Option<f64>], label: &str) -> String {
    const W: f64 = 180.0;
    const H: f64 = 36.0;
    let max = values.iter().flatten().copied().fold(0.0, f64::max);
    // A margin of 3 on the sides keeps the dots at the ends whole.
    let step = (W - 6.0) / (values.len().max(2) - 1) as f64;
    let mut path = String::new();
    let mut dots = String::new();
    let mut drawing = false;
    for (i, value) in values.iter().enumerate() {
        match value {
            Some(v) => {
                let (x, y) = (
                    3.0 + i as f64 * step,
                    if max > 0.0 {
                        H - 2.0 - v / max * (H - 4.0)
                    } else {
                        H - 2.0
                    },
                );
                // A point without neighbours draws no line: it gets a dot.
                if !drawing && !values.get(i + 1).is_some_and(Option::is_some) {
                    let _ = write!(
                        dots,
                        r##"<circle cx="{x:.1}" cy="{y:.1}" r="2" fill="#2a5db0"/>"##
                    );
                }
                let _ = write!(path, "{}{x:.1},{y:.1} ", if drawing { 'L' } else { 'M' });
                drawing = true;
            }
            None => drawing = false,
        }
    }
    format!(
        r##"<svg class="chart" width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img" aria-label="{label}"><rect width="{W}" height="{H}" fill="#f4f6fa"/><path d="{path}" fill="none" stroke="#2a5db0" stroke-width="1.5"/>{dots}</svg>"##,
        label = esc(label),
        path = path.trim_end(),
    )
}

/// At most this many bytes of a payload are shown; the rest is summarised.
pub const PAYLOAD_SHOWN: usize = 256 * 1024;

/// A hex dump: offset, 16 bytes in hex, the printable ASCII of them. Escaped.
pub fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 4 + 16);
    for (row, chunk) in bytes.chunks(16).enumerate() {
        let _ = write!(out, "{:08x}  ", row * 16);
        for i in 0..16 {
            match chunk.get(i) {
                Some(b) => {
                    let _ = write!(out, "{b:02x} ");
                }
                None => out.push_str("   "),
            }
        }
        out.push(' ');
        for &b in chunk {
            out.push(if b.is_ascii_graphic() || b == b' ' {
                b as char
            } else {
                '.'
            });
        }
        out.push('\n');
    }
    esc(&out)
}

/// A whole page: the frame (title, navigation, a logout button carrying the form token when
/// the console has credentials, read-only notice) around `body`, which must already be
/// escaped HTML.
pub fn frame(title: &str, read_only: bool, logout: Option<&str>, body: &str) -> String {
    let logout = logout.map_or(String::new(), |form_token| {
        format!(
            r#" <form class="inline" method="post" action="/logout"><input type="hidden" name="csrf" value="{}"><button>Log out</button></form>"#,
            esc(form_token)
        )
    });
    let notice = if read_only {
        r#"<p class="notice">Read-only console: actions are turned off (observability.console_read_only).</p>"#
    } else {
        ""
    };
    format!(
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} · outbox</title><link rel="stylesheet" href="/console.css"></head>
<body><header><strong>outbox</strong> <nav><a href="/">Overview</a> <a href="/parked">Parked keys</a> <a href="/dead-letters">Dead letters</a> <a href="/relays">Relays</a></nav>{logout}</header>
<main>{notice}<h1>{title}</h1>
{body}</main></body></html>
"#,
        title = esc(title),
    )
}

/// The console's style sheet, served by the binary (no CDN, nothing fetched at run time).
pub const CSS: &str = "body{font-family:system-ui,sans-serif;margin:0;color:#222}\
header{background:#223;color:#fff;padding:.6em 1em}header a{color:#cde;margin-left:1em}\
main{padding:1em}table{border-collapse:collapse;margin:.5em 0 1.5em}\
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}\
td.n{text-align:right}pre{background:#f4f4f4;padding:.6em;overflow:auto;max-height:40em}\
.notice{background:#fff3cd;padding:.5em}.error{background:#f8d7da;padding:.5em}\
.ok{color:#176b2c}.bad{color:#a00}form.inline{display:inline}\
button.danger{background:#a00;color:#fff}label{margin-right:1em}\
svg.chart{vertical-align:middle}.peak{color:#555;font-size:.85em}";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_leaves_no_markup() {
        assert_eq!(
            esc(r#"<script>alert('x')</script> & "q""#),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;q&quot;"
        );
        assert_eq!(
            hex(b"<a>\x00"),
            "00000000  3c 61 3e 00                                      &lt;a&gt;.\n"
        );
    }

    #[test]
    fn form_encoding_round_trips() {
        let text = "a b&c=d/é%";
        let decoded = pairs(&format!("x={}&id=1&id=2&empty=&bad=%zz+%4", url(text)));
        assert_eq!(decoded[0], ("x".into(), text.into()));
        assert_eq!(
            decoded[1..3],
            [("id".into(), "1".into()), ("id".into(), "2".into())]
        );
        assert_eq!(value(&decoded, "empty"), None);
        assert_eq!(value(&decoded, "bad"), Some("%zz %4"));
    }

    #[test]
    fn charts_scale_to_their_peak_and_leave_gaps() {
        let svg = chart(&[Some(0.0), Some(2.0), None, Some(1.0)], "rate <x>");
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"), "{svg}");
        // The peak touches the top margin, a gap starts a new line, the label is escaped.
        assert!(svg.contains("M3.0,34.0 L61.0,2.0 M177.0,18.0"), "{svg}");
        assert!(svg.contains("rate &lt;x&gt;"), "{svg}");
        assert!(svg.contains(r#"<circle cx="177.0" cy="18.0""#), "{svg}");
        assert_eq!(svg.matches("<circle").count(), 1, "{svg}");
        assert_eq!(seconds(0.25), "250 ms");
        assert_eq!(seconds(2.4), "2.40 s");
    }

    #[test]
    fn ages_read_well() {
        assert_eq!(age(4.25), "4.2s");
        assert_eq!(age(192.0), "3m 12s");
        assert_eq!(age(18120.0), "5h 2m");
        assert_eq!(age(-1.0), "0.0s");
    }
}

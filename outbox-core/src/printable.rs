//! Text that came from messages (topics, keys, payloads, broker errors) made safe to print in
//! a log line or on a terminal: whoever writes a message must not be able to forge a log line
//! with a newline, nor drive an operator's terminal with escape sequences.

use std::borrow::Cow;

/// `text` with every control character escaped as Rust writes it (`\n`, `\r`, `\t`,
/// `\u{1b}`), and every bidirectional-text control (U+202A–U+202E, U+2066–U+2069, U+200E,
/// U+200F, U+061C, which reorder what follows on screen) and invisible character (U+200B–
/// U+200D, U+2060, U+FEFF, which make two texts look alike) as `\u{…}`. Other text, any
/// script included, is kept; text with nothing to escape is returned as it is.
pub fn printable(text: &str) -> Cow<'_, str> {
    if !text.chars().any(needs_escape) {
        return Cow::Borrowed(text);
    }
    let mut escaped = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            escaped.extend(c.escape_default());
        } else if needs_escape(c) {
            escaped.extend(c.escape_unicode());
        } else {
            escaped.push(c);
        }
    }
    Cow::Owned(escaped)
}

fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{202A}'..='\u{202E}'
                | '\u{2066}'..='\u{2069}'
                | '\u{200B}'..='\u{200F}'
                | '\u{2060}'
                | '\u{FEFF}'
                | '\u{061C}'
        )
}

#[cfg(test)]
mod tests {
    use super::printable;

    #[test]
    fn newlines_escapes_and_bidi_controls_are_escaped() {
        // The security review's topics: a forged log line, terminal colours and a title.
        for (text, shown) in [
            (
                "forge\n2026-12-02T07:40:00Z  INFO outbox::console: console action",
                "forge\\n2026-12-02T07:40:00Z  INFO outbox::console: console action",
            ),
            (
                "logi\u{1b}[31mRED\u{1b}]0;TITLE\u{7}",
                "logi\\u{1b}[31mRED\\u{1b}]0;TITLE\\u{7}",
            ),
            ("t&\u{202E}gnp.exe", "t&\\u{202e}gnp.exe"),
            ("a\r\tb", "a\\r\\tb"),
        ] {
            assert_eq!(printable(text), shown);
        }
    }

    #[test]
    fn ordinary_text_is_kept_as_it_is() {
        for text in ["orders.created", "clé-ü-日本", "k 1 = x", ""] {
            assert!(matches!(printable(text), std::borrow::Cow::Borrowed(t) if t == text));
        }
    }
}

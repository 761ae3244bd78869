//! Keeping secrets out of logs and error messages.

/// Query parameters whose value is a secret: any whose name holds one of these.
const SECRET_PARAMETERS: [&str; 4] = ["pass", "pwd", "token", "secret"];

/// Replaces the secrets in a URL with `***` so the URL can be logged: the password in
/// `postgres://user:secret@host/db`, and the value of query parameters such as
/// `?password=…`, `?sslpassword=…`, `?token=…`. A URL without secrets is returned
/// unchanged. A user name alone (`amqp://guest@host`) is kept; for URLs where it is a token
/// (NATS), use [`redact_url_token`]. Text that is not a URL (no `://`: a typo, a libpq
/// `host=… password=…` string) is hidden whole as `***` when it could hold a secret in any
/// common shape (an `@`, a `=`, or a `:` not before a port), since where its secret
/// is cannot be told; `localhost:6379` is shown.
pub fn redact_url(url: &str) -> String {
    redact(url, false)
}

/// [`redact_url`], also hiding a user name given alone, which some clients read as a token
/// (`nats://t0ken@host` gives `nats://***@host`).
pub fn redact_url_token(url: &str) -> String {
    redact(url, true)
}

fn redact(url: &str, lone_user_is_secret: bool) -> String {
    let Some(scheme_end) = url.find("://") else {
        return if could_hold_a_secret(url) {
            "***".to_string()
        } else {
            url.to_string()
        };
    };
    let rest = &url[scheme_end + 3..];
    // A password typed raw may hold `/`, `?`, `#` or `@`, so the user info ends at the last
    // `@` of the URL, not at the first delimiter. An `@` in a path or query then hides more
    // than needed, which is the safe side.
    let authority_end = match rest.rfind('@') {
        Some(at) => at + rest[at..].find(['/', '?', '#']).unwrap_or(rest.len() - at),
        None => rest.find(['/', '?', '#']).unwrap_or(rest.len()),
    };
    let (authority, tail) = rest.split_at(authority_end);
    let authority = match authority.rfind('@') {
        Some(at) => {
            let (userinfo, host) = authority.split_at(at);
            match userinfo.find(':') {
                Some(colon) => format!("{}:***{host}", &userinfo[..colon]),
                None if lone_user_is_secret && !userinfo.is_empty() => format!("***{host}"),
                None => authority.to_string(),
            }
        }
        None => authority.to_string(),
    };
    format!("{}://{authority}{}", &url[..scheme_end], redact_query(tail))
}

/// The path, query and fragment of a URL with the values of secret parameters hidden.
fn redact_query(tail: &str) -> String {
    let Some(question) = tail.find('?') else {
        return tail.to_string();
    };
    let (path, query) = tail.split_at(question + 1);
    let (query, fragment) = query.split_at(query.find('#').unwrap_or(query.len()));
    let query = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if is_secret(name) => format!("{name}=***"),
            _ => pair.to_string(),
        })
        .collect::<Vec<_>>()
        .join("&");
    format!("{path}{query}{fragment}")
}

/// Whether text that is not a URL could hold a secret in a common shape: user info (`@`), a
/// `key=value` pair, or a `:` other than before a port
/// (`user:password`, where `localhost:6379` or `db:5432/x` is a host and port).
fn could_hold_a_secret(text: &str) -> bool {
    if text.contains(['@', '=']) {
        return true;
    }
    text.split(':').skip(1).any(|after| {
        let port = after.split('/').next().unwrap_or("");
        port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit())
    })
}

fn is_secret(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    SECRET_PARAMETERS.iter().any(|secret| name.contains(secret))
}

#[cfg(test)]
mod tests {
    use super::{redact_url, redact_url_token};

    #[test]
    fn hides_only_the_password() {
        for (url, hidden) in [
            (
                "postgres://app:s3cr@t@db:5432/x?sslmode=require",
                "postgres://app:***@db:5432/x?sslmode=require",
            ),
            (
                "redis://:pw@127.0.0.1:6379/0",
                "redis://:***@127.0.0.1:6379/0",
            ),
            ("amqp://guest@localhost", "amqp://guest@localhost"),
            ("redis://127.0.0.1/a@b", "redis://127.0.0.1/a@b"),
            ("not a url", "not a url"),
        ] {
            assert_eq!(redact_url(url), hidden);
        }
    }

    #[test]
    fn text_that_is_not_a_url_is_hidden_when_it_could_hold_a_secret() {
        // The review's cases: a libpq keyword string and a typo for redis://.
        let libpq = "host=127.0.0.1 user=postgres password=TopSECRET dbname=test";
        assert_eq!(redact_url(libpq), "***");
        assert_eq!(redact_url("redis//:TopSECRET@127.0.0.1:6379/0"), "***");
        assert_eq!(redact_url_token("app:TopSECRET"), "***");
        assert_eq!(
            redact_url("/var/lib/outbox/outbox.db"),
            "/var/lib/outbox/outbox.db"
        );
    }

    #[test]
    fn hides_a_raw_password_holding_url_delimiters() {
        for (url, hidden) in [
            (
                "postgres://app:x#S3c@127.0.0.1:1/test",
                "postgres://app:***@127.0.0.1:1/test",
            ),
            (
                "postgres://app:x/S3c@h:1/t?sslmode=require",
                "postgres://app:***@h:1/t?sslmode=require",
            ),
            ("redis://:x?S3c@127.0.0.1:1", "redis://:***@127.0.0.1:1"),
            ("amqp://guest:x@S3c@h:1/%2f", "amqp://guest:***@h:1/%2f"),
        ] {
            assert_eq!(redact_url(url), hidden);
            assert!(!redact_url_token(url).contains("S3c"), "{url}");
        }
    }

    #[test]
    fn hides_secret_query_parameters() {
        for (url, hidden) in [
            (
                "postgres://db/x?user=app&password=s3cr3t&sslmode=require#top",
                "postgres://db/x?user=app&password=***&sslmode=require#top",
            ),
            (
                "mysql://u:pw@db/x?sslPassword=k3y&Token=t&x",
                "mysql://u:***@db/x?sslPassword=***&Token=***&x",
            ),
            ("redis://h?db=2", "redis://h?db=2"),
        ] {
            assert_eq!(redact_url(url), hidden);
        }
    }

    #[test]
    fn a_lone_user_name_is_hidden_where_it_is_a_token() {
        for (url, hidden) in [
            ("nats://t0ken@127.0.0.1:4222", "nats://***@127.0.0.1:4222"),
            ("nats://user:pw@h:4222", "nats://user:***@h:4222"),
            ("nats://h:4222", "nats://h:4222"),
        ] {
            assert_eq!(redact_url_token(url), hidden);
        }
        // As a URL (not a token) the user name is kept.
        assert_eq!(redact_url("nats://t0ken@h"), "nats://t0ken@h");
    }
}

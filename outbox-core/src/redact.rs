//! Keeping secrets out of logs and error messages.

/// Replaces the password in a URL such as `postgres://user:secret@host/db` with `***`, so the
/// URL can be logged. A URL without a password is returned unchanged.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_string();
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_string();
    };
    let userinfo = &rest[..at];
    match userinfo.find(':') {
        Some(colon) => format!(
            "{}://{}:***{}",
            &url[..scheme_end],
            &userinfo[..colon],
            &rest[at..]
        ),
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn hides_only_the_password() {
        assert_eq!(
            redact_url("postgres://app:s3cr@t@db:5432/x?sslmode=require"),
            "postgres://app:***@db:5432/x?sslmode=require"
        );
        assert_eq!(
            redact_url("redis://:pw@127.0.0.1:6379/0"),
            "redis://:***@127.0.0.1:6379/0"
        );
        assert_eq!(
            redact_url("amqp://guest@localhost"),
            "amqp://guest@localhost"
        );
        assert_eq!(redact_url("redis://127.0.0.1/a@b"), "redis://127.0.0.1/a@b");
        assert_eq!(redact_url("not a url"), "not a url");
    }
}

//! Settings of the NATS JetStream sink.

use std::path::{Path, PathBuf};
use std::time::Duration;

use outbox_core::config::Settings;
use outbox_core::{Error, Result, Template, redact_url_token};

/// Settings of the NATS JetStream sink: the `[sink]` table of the relay's configuration file
/// (`type = "nats"`, durations written `"5s"` or `"500ms"`, unknown keys refused) and the
/// Rust API alike. Every key has a default. `Debug` hides the password in the URL and the
/// token, and shows only the paths of the credential files, never their contents.
#[derive(Clone, PartialEq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsConfig {
    /// Server URL: `nats://[user:password@]host:port`, or `tls://...` for TLS (default
    /// `nats://127.0.0.1:4222`). Several servers of one cluster may be given separated by
    /// commas.
    pub url: String,
    /// The subject of each message: this template with every `{topic}` replaced by the
    /// message's topic (default `{topic}`); `{key}` is refused. The subject must be captured
    /// by a JetStream stream (`nats stream add --subjects ...`); this sink creates no streams.
    pub subject: Template,
    /// Prepended to every subject (default empty), e.g. `outbox.`.
    pub subject_prefix: String,
    /// When set, JetStream refuses a message whose subject is captured by any other stream
    /// (the `Nats-Expected-Stream` header), so a misconfigured subject cannot land
    /// somewhere unexpected. Such a message is dead-lettered.
    pub stream: Option<String>,
    /// A header that repeats the message's partition key besides the envelope's
    /// [`wire::KEY`](crate::wire::KEY) (`outbox-key`), for consumers of an older layout
    /// (`Outbox-Key`); none by default. Absent when the message has no key.
    pub key_header: Option<String>,
    /// Longest wait to connect, to hand a message to the connection, and for a batch's
    /// acknowledgements (default 5 s). A time-out counts as the server being unavailable.
    /// Keep it shorter than the worker's lease.
    #[serde(with = "humantime_serde")]
    pub publish_timeout: Duration,
    /// Publishes whose acknowledgements are awaited together (default 5000): a larger
    /// batch is published in windows of this many messages, in order.
    pub max_pending_acks: usize,
    /// Token for token authentication; a secret, never logged.
    pub token: Option<String>,
    /// A NATS credentials file (`.creds`: a user JWT and its NKey seed, as `nsc generate
    /// creds` writes it) for servers in operator (JWT) mode; read and checked when the sink
    /// is built. Excludes every other way to authenticate (default none).
    pub credentials_file: Option<PathBuf>,
    /// A file holding a user's NKey seed (`SU…`, as `nk -gen user` writes it) for servers
    /// that list users by NKey; read and checked when the sink is built. Excludes every
    /// other way to authenticate (default none).
    pub nkey_file: Option<PathBuf>,
    /// A PEM file of the certificate authorities that sign the server's certificate, trusted
    /// besides the system's roots; setting it requires TLS (default none).
    pub tls_ca_file: Option<PathBuf>,
    /// A PEM client certificate for servers that verify clients, with
    /// [`tls_key_file`](Self::tls_key_file); requires TLS (default none).
    pub tls_cert_file: Option<PathBuf>,
    /// The PEM private key of [`tls_cert_file`](Self::tls_cert_file) (default none).
    pub tls_key_file: Option<PathBuf>,
    /// The client's name as the server shows it in its connection list (default `outbox`).
    pub name: String,
}

impl Default for NatsConfig {
    fn default() -> Self {
        NatsConfig {
            url: "nats://127.0.0.1:4222".into(),
            subject: Template::topic(),
            subject_prefix: String::new(),
            stream: None,
            key_header: None,
            publish_timeout: Duration::from_secs(5),
            max_pending_acks: 5000,
            token: None,
            credentials_file: None,
            nkey_file: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            name: "outbox".into(),
        }
    }
}

outbox_core::debug_fields!(NatsConfig, |config| {
    url: redact_servers(&config.url),
    subject, subject_prefix, stream, key_header, publish_timeout, max_pending_acks,
    token: config.token.as_ref().map(|_| "***"),
    credentials_file: config.credentials_file.as_deref().map(shown_path),
    nkey_file: config.nkey_file.as_deref().map(shown_path),
    tls_ca_file: config.tls_ca_file.as_deref().map(shown_path),
    tls_cert_file: config.tls_cert_file.as_deref().map(shown_path),
    tls_key_file: config.tls_key_file.as_deref().map(shown_path),
    name,
});

/// How the sink authenticates: a token or a user and password (from `token` or written in a
/// server URL, `nats://t0ken@host`, `nats://user:pw@host`), or what `credentials_file` or
/// `nkey_file` holds. Secrets all: no `Debug`, never logged.
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum Credentials {
    Token(String),
    UserPassword(String, String),
    /// The text of a `.creds` file, checked to hold a user JWT and a valid NKey seed.
    Creds(String),
    /// A user's NKey seed, checked.
    NkeySeed(String),
}

impl Credentials {
    /// What the credentials are, for errors (never the secret itself).
    fn kind(&self) -> &'static str {
        match self {
            Credentials::Token(_) => "a token",
            Credentials::UserPassword(..) => "a user and password",
            Credentials::Creds(_) => "a credentials file",
            Credentials::NkeySeed(_) => "an NKey seed",
        }
    }
}

/// `url` without its user information, and the credentials that held.
fn take_credentials(url: &str) -> (String, Option<Credentials>) {
    let Some(scheme_end) = url.find("://") else {
        return (url.to_string(), None);
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return (url.to_string(), None);
    };
    let userinfo = &rest[..at];
    let credentials = match userinfo.split_once(':') {
        Some((user, password)) => Credentials::UserPassword(user.into(), password.into()),
        None => Credentials::Token(userinfo.into()),
    };
    let bare = format!("{}{}", &url[..scheme_end + 3], &rest[at + 1..]);
    (bare, (!userinfo.is_empty()).then_some(credentials))
}

/// The error for a file setting that holds a file's contents rather than its path.
const CONTENTS_NOT_PATH: &str = "holds what looks like a key or credentials themselves, not the \
                                 path of a file; give the path (`{ file = \"…\" }` would read \
                                 the file in)";

/// Whether a file setting's "path" is rather the secret itself: `credentials_file = { file =
/// "…" }` in the relay's configuration gives the file's text (a JWT, a seed, a PEM key), not
/// its path. Such a value is never printed.
fn is_a_secret(path: &Path) -> bool {
    let text = path.to_string_lossy();
    text.contains('\n') || text.contains("-----BEGIN") || nkeys::decode_seed(text.trim()).is_ok()
}

/// A file setting's path for `Debug`, or `***` when it is a secret (see [`is_a_secret`]).
fn shown_path(path: &Path) -> String {
    if is_a_secret(path) {
        "***".into()
    } else {
        path.display().to_string()
    }
}

/// The URL list with each password and token replaced by `***`, for logs and errors.
pub(crate) fn redact_servers(url: &str) -> String {
    url.split(',')
        .map(|u| redact_url_token(u.trim()))
        .collect::<Vec<_>>()
        .join(",")
}

impl Settings for NatsConfig {
    /// Checks every setting; the error is keyed by the bad one (the caller places it in its
    /// section with [`Error::in_section`]).
    fn validate(&self) -> Result<()> {
        let (servers, in_url) = self.servers()?;
        if servers.is_empty() {
            return Err(Error::setting(
                "url",
                "is empty; give the NATS server, e.g. nats://127.0.0.1:4222",
            ));
        }
        if self.subject.as_str().is_empty() {
            return Err(Error::setting(
                "subject",
                "is empty; give a template such as `{topic}` or `events.{topic}`",
            ));
        }
        self.subject.refuse_key("subject")?;
        // A topic made of one plain token must give a valid subject.
        let sample = self.subject_for("topic").map_err(|why| {
            Error::setting(
                "subject",
                format!(
                    "`{}` with subject_prefix `{}` does not make a valid subject: {why}",
                    self.subject, self.subject_prefix
                ),
            )
        })?;
        if !self.subject.uses_topic() {
            tracing::info!(subject = %sample, "the subject template has no {{topic}}: every topic goes to one subject");
        }
        if let Some(stream) = &self.stream
            && (stream.is_empty() || stream.contains(['.', '*', '>', ' ', '\t', '/', '\\']))
        {
            return Err(Error::setting(
                "stream",
                format!(
                    "`{stream}` is not a JetStream stream name (non-empty, without '.', '*', \
                     '>', '/', '\\' or spaces); leave it unset to accept any stream"
                ),
            ));
        }
        if let Some(key_header) = &self.key_header {
            if async_nats::HeaderName::try_from(key_header.as_str()).is_err()
                || key_header.is_empty()
            {
                return Err(Error::setting(
                    "key_header",
                    format!(
                        "`{key_header}` is not a valid header name (printable ASCII without ':' \
                         or spaces)"
                    ),
                ));
            }
            if key_header.to_ascii_lowercase().starts_with("nats-") {
                return Err(Error::setting(
                    "key_header",
                    format!(
                        "`{key_header}` starts with `Nats-`, which NATS reserves; pick another name"
                    ),
                ));
            }
        }
        outbox_core::config::check_publish_timeout(
            self.publish_timeout,
            Duration::from_millis(10),
        )?;
        outbox_core::config::check_at_least_one("max_pending_acks", self.max_pending_acks as u64)?;
        for (key, file) in [
            ("tls_ca_file", &self.tls_ca_file),
            ("tls_cert_file", &self.tls_cert_file),
            ("tls_key_file", &self.tls_key_file),
        ] {
            if file.as_deref().is_some_and(is_a_secret) {
                return Err(Error::setting(key, CONTENTS_NOT_PATH));
            }
        }
        outbox_core::config::check_tls_files(
            self.tls_ca_file.as_deref(),
            self.tls_cert_file.as_deref(),
            self.tls_key_file.as_deref(),
        )?;
        if self.token.as_ref().is_some_and(|t| t.is_empty()) {
            return Err(Error::setting(
                "token",
                "is empty; leave it unset for no token",
            ));
        }
        // A server takes one way to authenticate; two given would leave one silently unused.
        if self.credentials_file.is_some() && self.nkey_file.is_some() {
            return Err(Error::setting(
                "credentials_file",
                "and nkey_file are two ways to authenticate; give one of them (a .creds file \
                 holds its own NKey seed)",
            ));
        }
        for (key, file) in [
            ("credentials_file", &self.credentials_file),
            ("nkey_file", &self.nkey_file),
        ] {
            if file.is_none() {
                continue;
            }
            if self.token.is_some() {
                return Err(Error::setting(
                    key,
                    "and token are two ways to authenticate; give one of them",
                ));
            }
            if let Some(in_url) = &in_url {
                return Err(Error::setting(
                    key,
                    format!(
                        "is set and url carries {} too; a server takes one way to \
                         authenticate: remove it from url, or unset {key}",
                        in_url.kind()
                    ),
                ));
            }
        }
        self.file_credentials()?;
        Ok(())
    }
}

impl NatsConfig {
    /// Defaults for the server at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        NatsConfig {
            url: url.into(),
            ..Self::default()
        }
    }

    /// The credentials of `credentials_file` or `nkey_file`, read and checked; a `Config`
    /// error naming the key and the file when it cannot be read or does not hold them.
    pub(crate) fn file_credentials(&self) -> Result<Option<Credentials>> {
        let read = |key: &str, file: &PathBuf| {
            if is_a_secret(file) {
                return Err(Error::setting(key, CONTENTS_NOT_PATH));
            }
            std::fs::read_to_string(file).map_err(|e| {
                Error::setting(key, format!("`{}` cannot be read: {e}", file.display()))
            })
        };
        if let Some(file) = &self.credentials_file {
            let creds = read("credentials_file", file)?;
            // The client's own parser, so what passes here is what it will use.
            if let Err(why) = async_nats::ConnectOptions::new().credentials(&creds) {
                return Err(Error::setting(
                    "credentials_file",
                    format!(
                        "`{}` is not a NATS credentials file ({why}); give the .creds file \
                         that `nsc generate creds` writes: a user JWT and its NKey seed",
                        file.display()
                    ),
                ));
            }
            return Ok(Some(Credentials::Creds(creds)));
        }
        if let Some(file) = &self.nkey_file {
            let seed = read("nkey_file", file)?.trim().to_string();
            let bad = |why: String| {
                Error::setting(
                    "nkey_file",
                    format!(
                        "`{}` does not hold a user's NKey seed ({why}); give a file with the \
                         seed alone, starting `SU` (`nk -gen user`)",
                        file.display()
                    ),
                )
            };
            let pair = nkeys::KeyPair::from_seed(&seed).map_err(|e| bad(e.to_string()))?;
            if pair.key_pair_type() != nkeys::KeyPairType::User {
                return Err(bad(format!(
                    "it is the seed of a key of type {:?}, not User",
                    pair.key_pair_type()
                )));
            }
            return Ok(Some(Credentials::NkeySeed(seed)));
        }
        Ok(None)
    }

    /// The parsed server addresses, without the credentials a URL may carry (the client
    /// logs its server addresses at debug level), and those credentials; a bad address is a
    /// `Config` error keyed `url`.
    pub(crate) fn servers(&self) -> Result<(Vec<async_nats::ServerAddr>, Option<Credentials>)> {
        let mut credentials = None;
        let mut servers = Vec::new();
        for written in self.url.split(',').map(str::trim).filter(|u| !u.is_empty()) {
            let (u, carried) = take_credentials(written);
            credentials = credentials.or(carried);
            let bad = |why: String| {
                Error::setting(
                    "url",
                    format!(
                        "`{}` is not a NATS server URL ({why}); expected nats://host:port or tls://host:port",
                        redact_url_token(written)
                    ),
                )
            };
            let addr = u
                .parse::<async_nats::ServerAddr>()
                .map_err(|e| bad(e.to_string()))?;
            if addr.scheme().starts_with("ws") {
                return Err(bad("WebSocket URLs are not supported by this build".into()));
            }
            servers.push(addr);
        }
        Ok((servers, credentials))
    }

    /// The subject for `topic`, or why it would not be a valid subject to publish to.
    pub(crate) fn subject_for(&self, topic: &str) -> std::result::Result<String, String> {
        let subject = format!("{}{}", self.subject_prefix, self.subject.render(topic, ""));
        if subject.is_empty() {
            return Err("the subject is empty".into());
        }
        if subject.contains(|c: char| c.is_whitespace() || c.is_control()) {
            return Err(format!("subject `{subject}` contains white space"));
        }
        if subject.split('.').any(str::is_empty) {
            return Err(format!(
                "subject `{subject}` has an empty token (a leading, trailing or double '.')"
            ));
        }
        if subject.split('.').any(|t| t == "*" || t == ">") {
            return Err(format!(
                "subject `{subject}` has a wildcard token ('*' or '>')"
            ));
        }
        Ok(subject)
    }
}

outbox_core::setters!(NatsConfig {
    /// Sets the subject prefix and template.
    subject(prefix: impl Into<String>, template: Template) => subject_prefix = prefix.into(),
        subject = template;
    /// Sets the longest wait to connect, to hand a window over and for its acknowledgements.
    publish_timeout(timeout: Duration) => publish_timeout = timeout;
});

#[cfg(test)]
mod tests {
    use super::*;

    fn template(text: &str) -> Template {
        Template::new(text).unwrap()
    }

    #[test]
    fn credentials_are_taken_out_of_the_server_addresses() {
        let config = |url: &str| NatsConfig {
            url: url.into(),
            ..NatsConfig::default()
        };
        let (servers, credentials) = config("nats://t0ken@127.0.0.1:4222, nats://h2:4222")
            .servers()
            .unwrap();
        assert!(credentials == Some(Credentials::Token("t0ken".into())));
        let shown = format!("{servers:?}");
        assert!(!shown.contains("t0ken") && shown.contains("h2"), "{shown}");
        let (servers, credentials) = config("nats://app:pw@h:4222").servers().unwrap();
        assert!(credentials == Some(Credentials::UserPassword("app".into(), "pw".into())));
        assert!(!format!("{servers:?}").contains("pw"));
        assert!(config("nats://h:4222").servers().unwrap().1.is_none());
        let error = config("nats://t0ken@h:port")
            .servers()
            .err()
            .expect("refused")
            .to_string();
        assert!(!error.contains("t0ken") && error.contains("url"), "{error}");
    }

    #[test]
    fn reads_json_with_durations_and_names_bad_keys() {
        let config = NatsConfig::from_value(serde_json::json!({
            "url": "nats://app:s3cret@127.0.0.1:4222",
            "subject_prefix": "outbox.",
            "publish_timeout": "250ms",
            "token": "tok",
        }))
        .unwrap();
        assert_eq!(config.publish_timeout, Duration::from_millis(250));
        assert_eq!(config.subject_for("orders").unwrap(), "outbox.orders");
        let debug = format!("{config:?}");
        assert!(
            !debug.contains("s3cret") && !debug.contains("tok\""),
            "{debug}"
        );

        outbox_testkit::check_sink_settings_refused::<NatsConfig>([
            (
                serde_json::json!({ "urll": "x" }),
                "sink.urll: unknown field `urll`",
            ),
            (
                serde_json::json!({ "timeout": "5s" }),
                "sink.timeout: unknown field `timeout`",
            ),
            (
                serde_json::json!({ "max_pending_acks": "many" }),
                "sink.max_pending_acks: ",
            ),
            (
                serde_json::json!({ "publish_timeout": "soon" }),
                "sink.publish_timeout: ",
            ),
            (
                serde_json::json!({ "subject": "{topc}" }),
                "sink.subject: `{topc}` uses the unknown placeholder",
            ),
            (
                serde_json::json!({ "credentials_file": "/nowhere/app.creds" }),
                "sink.credentials_file `/nowhere/app.creds` cannot be read",
            ),
            (
                serde_json::json!({ "publish_timeout": "0s" }),
                "sink.publish_timeout is 0ns",
            ),
        ]);
    }

    #[test]
    fn validation_names_the_key() {
        let check = |f: fn(&mut NatsConfig), key: &str| {
            let mut config = NatsConfig::default();
            f(&mut config);
            let error = config.validate().unwrap_err();
            assert_eq!(error.kind(), outbox_core::ErrorKind::Config);
            assert!(error.message().starts_with(key), "{key}: {error}");
        };
        check(|c| c.url = "http://[::".into(), "url `http://[::`");
        check(|c| c.url = " ".into(), "url is empty");
        check(|c| c.subject = template(""), "subject is empty");
        check(
            |c| c.subject = template("a..{topic}"),
            "subject `a..{topic}` with subject_prefix",
        );
        check(
            |c| c.subject_prefix = "x y.".into(),
            "subject `{topic}` with subject_prefix `x y.`",
        );
        check(|c| c.subject = template("{topic}.>"), "subject `{topic}.>`");
        check(
            |c| c.subject = template("{topic}.{key}"),
            "subject `{topic}.{key}` uses {key}",
        );
        check(|c| c.stream = Some("a.b".into()), "stream `a.b`");
        check(
            |c| c.key_header = Some("bad:name".into()),
            "key_header `bad:name`",
        );
        check(
            |c| c.key_header = Some("Nats-Key".into()),
            "key_header `Nats-Key`",
        );
        check(
            |c| c.publish_timeout = Duration::ZERO,
            "publish_timeout is 0ns",
        );
        check(|c| c.max_pending_acks = 0, "max_pending_acks is 0");
        check(|c| c.token = Some(String::new()), "token is empty");
        assert!(NatsConfig::default().validate().is_ok());
        assert_eq!(
            NatsConfig::default()
                .publish_timeout(Duration::ZERO)
                .validate()
                .unwrap_err()
                .in_section("relay[orders].sink")
                .message(),
            "relay[orders].sink.publish_timeout is 0ns; it must be at least 10ms (and shorter \
             than the worker's lease)"
        );
    }

    /// A `.creds` file as `nsc` writes it.
    fn creds_text(jwt: &str, seed: &str) -> String {
        format!(
            "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
             ************************* IMPORTANT *************************\n\n\
             -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
        )
    }

    #[test]
    fn credential_files_are_read_checked_and_exclusive() {
        let dir = std::env::temp_dir().join(format!("outbox_nats_creds_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let seed = nkeys::KeyPair::new_user().seed().unwrap();
        let jwt = "eyJ0eXAiOiJKV1QifQ.eyJzZWNyZXQiOjF9.c2lnbmF0dXJl";
        let creds = write("user.creds", &creds_text(jwt, &seed));
        let nkey = write("user.nk", &format!("{seed}\n"));
        let short_seed = &seed[..40];
        let bad_seed = write("bad-seed.creds", &creds_text(jwt, short_seed));
        let garbage = write("garbage", "not credentials\n");
        let account = write("account.nk", &nkeys::KeyPair::new_account().seed().unwrap());
        let with = |credentials_file: Option<&PathBuf>, nkey_file: Option<&PathBuf>| NatsConfig {
            credentials_file: credentials_file.cloned(),
            nkey_file: nkey_file.cloned(),
            ..NatsConfig::default()
        };
        let refused = |config: NatsConfig, starts: &str| {
            let error = config.validate().expect_err(starts);
            assert_eq!(error.kind(), outbox_core::ErrorKind::Config);
            let message = error.message().to_string();
            assert!(message.starts_with(starts), "{starts}: {message}");
            for secret in [seed.as_str(), short_seed, jwt, "pw", "t0k", "MIIpt"] {
                assert!(!message.contains(secret), "{message}");
            }
            message
        };

        let config = with(Some(&creds), None);
        config.validate().unwrap();
        assert!(
            config.file_credentials().unwrap() == Some(Credentials::Creds(creds_text(jwt, &seed)))
        );
        let debug = format!("{config:?}");
        assert!(
            debug.contains("user.creds") && !debug.contains(&seed) && !debug.contains(jwt),
            "{debug}"
        );
        let config = with(None, Some(&nkey));
        config.validate().unwrap();
        assert!(config.file_credentials().unwrap() == Some(Credentials::NkeySeed(seed.clone())));

        let missing = PathBuf::from("/nowhere/user.creds");
        refused(
            with(Some(&missing), None),
            "credentials_file `/nowhere/user.creds` cannot be read",
        );
        let message = refused(with(Some(&garbage), None), "credentials_file `");
        assert!(
            message.contains("garbage` is not a NATS credentials file"),
            "{message}"
        );
        let message = refused(with(Some(&bad_seed), None), "credentials_file `");
        assert!(
            message.contains("bad-seed.creds` is not a NATS credentials file"),
            "{message}"
        );
        let message = refused(with(None, Some(&garbage)), "nkey_file `");
        assert!(
            message.contains("garbage` does not hold a user's NKey seed"),
            "{message}"
        );
        let message = refused(with(None, Some(&account)), "nkey_file `");
        assert!(message.contains("of type Account, not User"), "{message}");
        let inline = PathBuf::from(creds_text(jwt, &seed));
        refused(
            with(Some(&inline), None),
            "credentials_file holds what looks like a key or credentials",
        );
        let debug = format!("{:?}", with(Some(&inline), None));
        assert!(!debug.contains(&seed) && !debug.contains(jwt), "{debug}");
        let inline = PathBuf::from(&seed);
        refused(
            with(None, Some(&inline)),
            "nkey_file holds what looks like a key or credentials",
        );
        assert!(!format!("{:?}", with(None, Some(&inline))).contains(&seed));
        let pem = NatsConfig {
            tls_cert_file: Some("/etc/hostname".into()),
            tls_key_file: Some(
                "-----BEGIN PRIVATE KEY-----\nMIIpt\n-----END PRIVATE KEY-----".into(),
            ),
            ..NatsConfig::default()
        };
        assert!(!format!("{pem:?}").contains("MIIpt"));
        refused(
            pem,
            "tls_key_file holds what looks like a key or credentials",
        );
        refused(
            with(Some(&creds), Some(&nkey)),
            "credentials_file and nkey_file are two ways",
        );
        refused(
            NatsConfig {
                token: Some("t0k".into()),
                ..with(Some(&creds), None)
            },
            "credentials_file and token are two ways",
        );
        refused(
            NatsConfig {
                url: "nats://app:pw@h:4222".into(),
                ..with(None, Some(&nkey))
            },
            "nkey_file is set and url carries a user and password too",
        );
        refused(
            NatsConfig {
                url: "nats://h1:4222,nats://t0k@h2:4222".into(),
                ..with(Some(&creds), None)
            },
            "credentials_file is set and url carries a token too",
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn subjects_are_checked_per_topic() {
        let config = NatsConfig::default();
        assert_eq!(
            config.subject_for("orders.created").unwrap(),
            "orders.created"
        );
        assert!(config.subject_for("has space").is_err());
        assert!(config.subject_for("").is_err());
        assert!(config.subject_for("a.*").is_err());
        assert!(config.subject_for("trailing.").is_err());
    }
}

//! Certificates for TLS tests, made at test time: a certificate authority, a server
//! certificate for 127.0.0.1 and localhost, and a client certificate, all signed by it, as
//! PEM files. Two calls give two unrelated authorities, for the "wrong CA" checks.

use std::path::{Path, PathBuf};

use outbox_core::{ErrorKind, Message, Outcome, Sink};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

/// A certificate authority and a certificate it signed, as PEM files in `dir`.
pub struct Pki {
    /// The authority's certificate.
    pub ca: PathBuf,
    /// The server's certificate and key.
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    /// The client's certificate and key.
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

/// Makes an authority named `name` and its certificates, written to `dir`.
pub fn pki(dir: &Path, name: &str) -> Pki {
    let write = |file: &str, text: String| {
        let path = dir.join(format!("{name}-{file}"));
        std::fs::write(&path, text).expect("write a PEM file");
        path
    };
    let ca_key = KeyPair::generate().expect("key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("outbox test CA {name}"));
    let ca = ca_params.self_signed(&ca_key).expect("CA");
    let leaf = |names: Vec<String>, purpose: ExtendedKeyUsagePurpose| {
        let key = KeyPair::generate().expect("key");
        let mut params = CertificateParams::new(names).expect("params");
        params.extended_key_usages = vec![purpose];
        let cert = params.signed_by(&key, &ca, &ca_key).expect("signed");
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(
        vec!["127.0.0.1".into(), "localhost".into()],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (client_cert, client_key) = leaf(
        vec!["outbox-relay".into()],
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    Pki {
        ca: write("ca.pem", ca.pem()),
        server_cert: write("server.pem", server_cert),
        server_key: write("server.key", server_key),
        client_cert: write("client.pem", client_cert),
        client_key: write("client.key", client_key),
    }
}

/// A fresh directory named after `prefix` under the system's temporary directory, with two
/// unrelated authorities in it: `ours` (for the server and the client) and `theirs` (for the
/// "wrong CA" checks). The test removes the directory when it passes.
pub fn two_authorities(prefix: &str) -> (PathBuf, Pki, Pki) {
    let dir = std::env::temp_dir().join(crate::unique_name(prefix));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let ours = pki(&dir, "ours");
    let theirs = pki(&dir, "theirs");
    (dir, ours, theirs)
}

/// Checks that `sink` passes its health check over the TLS it is configured with and
/// delivers every message of `batch`.
pub async fn assert_delivers_over_tls(sink: &dyn Sink, batch: &[Message]) {
    sink.health().await.expect("a verified TLS connection");
    let outcomes = sink.publish(batch).await.expect("publish over TLS");
    assert_eq!(outcomes.len(), batch.len(), "{outcomes:?}");
    assert!(
        outcomes.iter().all(|o| matches!(o, Outcome::Delivered(_))),
        "{outcomes:?}"
    );
}

/// Checks that `sink`, which trusts another authority than the server's, fails its health
/// check as `Unavailable`: it does not accept the server's certificate.
pub async fn assert_wrong_ca_refused(sink: &dyn Sink) {
    let error = sink
        .health()
        .await
        .expect_err("the server's certificate must be refused");
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
}

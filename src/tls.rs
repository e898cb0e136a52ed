//! Which servers tollgate trusts when it speaks TLS: upstreams, OTLP collectors and alert
//! webhooks alike. The Mozilla roots compiled into the binary (webpki-roots, so the image needs
//! no CA bundle), plus every certificate in the PEM file `SSL_CERT_FILE` names, when it is set:
//! a private CA in front of an internal Ollama, a TLS-inspecting corporate proxy, a collector
//! with its own certificate. The file is read once; `tollgate serve` reads it before it serves
//! and refuses to start when it cannot be read or holds no certificate (every TLS call would
//! fail later, one by one, instead).

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::{ClientConfig, RootCertStore};
use std::path::Path;
use std::sync::{Arc, OnceLock};

/// The variable naming a PEM file of certificates to trust besides the compiled-in roots (the
/// name OpenSSL, curl, Go and Python read).
pub const CA_FILE_VAR: &str = "SSL_CERT_FILE";

/// The roots, made once: `Err` says why `SSL_CERT_FILE` could not be used.
static ROOTS: OnceLock<Result<Roots, String>> = OnceLock::new();

struct Roots {
    store: Arc<RootCertStore>,
    /// Certificates added from `SSL_CERT_FILE`.
    added: usize,
}

fn roots() -> &'static Result<Roots, String> {
    ROOTS.get_or_init(
        || match std::env::var_os(CA_FILE_VAR).filter(|v| !v.is_empty()) {
            None => Ok(webpki_only()),
            Some(path) => with_file(Path::new(&path)),
        },
    )
}

/// The Mozilla roots compiled into the binary.
fn compiled_in() -> RootCertStore {
    RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    }
}

fn webpki_only() -> Roots {
    Roots {
        store: Arc::new(compiled_in()),
        added: 0,
    }
}

/// The compiled-in roots plus every certificate of the PEM file at `path`.
fn with_file(path: &Path) -> Result<Roots, String> {
    let at = || format!("{CA_FILE_VAR}={}", path.display());
    let pem = std::fs::read(path).map_err(|e| format!("{}: cannot read it: {e}", at()))?;
    let mut store = compiled_in();
    let mut added = 0;
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| format!("{}: not a PEM file of certificates: {e}", at()))?;
        store
            .add(cert)
            .map_err(|e| format!("{}: a certificate it holds is not usable: {e}", at()))?;
        added += 1;
    }
    if added == 0 {
        return Err(format!(
            "{}: holds no certificate (expected PEM blocks `-----BEGIN CERTIFICATE-----`)",
            at()
        ));
    }
    Ok(Roots {
        store: Arc::new(store),
        added,
    })
}

/// Reads `SSL_CERT_FILE` (once) and says how many certificates it added, or why it cannot be
/// used. `tollgate serve` calls this before it serves.
pub fn init() -> Result<usize, String> {
    roots().as_ref().map(|r| r.added).map_err(Clone::clone)
}

/// A client configuration trusting the roots above, for a TLS connector. When `SSL_CERT_FILE`
/// could not be used (said by [`init`] at start), the compiled-in roots alone.
pub fn client_config() -> ClientConfig {
    let store = match roots() {
        Ok(r) => r.store.clone(),
        Err(_) => Arc::new(compiled_in()),
    };
    ClientConfig::builder()
        .with_root_certificates(store)
        .with_no_client_auth()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate, PEM, made for the test.
    fn ca_pem() -> String {
        rcgen::generate_simple_self_signed(vec!["tollgate-test-ca".to_string()])
            .expect("certificate")
            .cert
            .pem()
    }

    fn file(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().expect("temp file");
        std::io::Write::write_all(&mut f, text.as_bytes()).expect("write");
        f
    }

    #[test]
    fn a_pem_file_adds_its_certificates_to_the_compiled_in_roots() {
        let ca = ca_pem();
        let f = file(&ca);
        let r = with_file(f.path()).expect("usable");
        assert_eq!(r.added, 1);
        assert_eq!(r.store.len(), webpki_roots::TLS_SERVER_ROOTS.len() + 1);
        // Twice in one bundle, with text around it (as bundles have): both read.
        let f = file(&format!("# internal CA\n{ca}\nsome note\n{}", ca_pem()));
        assert_eq!(with_file(f.path()).expect("usable").added, 2);
    }

    #[test]
    fn an_unusable_file_is_refused_with_the_variable_and_the_reason() {
        let missing = with_file(Path::new("/nonexistent/ca.pem"))
            .err()
            .expect("refused");
        assert!(
            missing.starts_with("SSL_CERT_FILE=/nonexistent/ca.pem: cannot read it"),
            "{missing}"
        );
        let empty = with_file(file("no certificates here\n").path())
            .err()
            .expect("refused");
        assert!(empty.contains("holds no certificate"), "{empty}");
        // A key is not a certificate: nothing added, refused.
        let key = file("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n");
        assert!(with_file(key.path()).is_err());
        // A certificate block whose contents are not a certificate.
        let junk = file("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n");
        let e = with_file(junk.path()).err().expect("refused");
        assert!(e.contains("not usable"), "{e}");
        // A broken PEM block (no end line).
        let ca = ca_pem();
        let cut = &ca[..ca.len() / 2];
        let e = with_file(file(cut).path()).err().expect("refused");
        assert!(e.starts_with("SSL_CERT_FILE="), "{e}");
    }

    #[test]
    fn the_client_configuration_trusts_the_compiled_in_roots() {
        // The test process sets no SSL_CERT_FILE (CI does not): the roots are webpki's.
        if std::env::var_os(CA_FILE_VAR).is_none() {
            assert_eq!(init(), Ok(0));
            let r = roots().as_ref().expect("usable");
            assert_eq!(r.store.len(), webpki_roots::TLS_SERVER_ROOTS.len());
        }
        let c = client_config();
        assert!(c.alpn_protocols.is_empty(), "the connector sets ALPN");
    }
}

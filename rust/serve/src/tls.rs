//! gRPC over TLS (Triton's `--grpc-use-ssl`, `--grpc-use-ssl-mutual`): the
//! gRPC listener's connections are TLS (rustls, ALPN `h2`) before h2 sees
//! them; with mutual authentication a client must present a certificate
//! that the root certificates sign.
//!
//! The files are read and checked when the front-end is configured, so a
//! missing file, a key that is not the certificate's or a PEM with nothing
//! in it fails the start with the file's name, never the first handshake.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::crypto::aws_lc_rs::default_provider;
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};
use tokio_rustls::TlsAcceptor;

/// The most bytes a certificate or key file may hold (a chain of a few
/// certificates is a few KiB): checked before the file is read.
const MAX_PEM_FILE: u64 = 1 << 20;

/// Where the server's certificate and key are, and who may connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The server's certificate chain (PEM), leaf first.
    pub cert: PathBuf,
    /// The certificate's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The certificates that sign clients' certificates (PEM); needed for,
    /// and only read with, `mutual`.
    pub root: Option<PathBuf>,
    /// Clients must present a certificate the roots sign.
    pub mutual: bool,
}

/// A configured TLS server side: what each gRPC connection's handshake uses.
#[derive(Clone)]
pub struct Tls {
    acceptor: TlsAcceptor,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls").finish_non_exhaustive()
    }
}

impl Tls {
    /// Reads and checks `files`; the error names the file and what is wrong.
    pub fn from_files(files: &TlsFiles) -> Result<Tls, String> {
        let provider = Arc::new(default_provider());
        let certs = certificates(&files.cert, "server certificate")?;
        let key = PrivateKeyDer::from_pem_slice(&read(&files.key, "server key")?).map_err(|e| {
            format!(
                "server key {}: no private key in it ({e})",
                files.key.display()
            )
        })?;
        let verifier = if files.mutual {
            let Some(root) = &files.root else {
                return Err(
                    "mutual TLS needs the root certificates that sign clients' certificates".into(),
                );
            };
            let mut roots = RootCertStore::empty();
            for cert in certificates(root, "root certificate")? {
                roots
                    .add(cert)
                    .map_err(|e| format!("root certificate {}: {e}", root.display()))?;
            }
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .map_err(|e| format!("root certificate {}: {e}", root.display()))?
        } else {
            WebPkiClientVerifier::no_client_auth()
        };
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs, key)
            .map_err(|e| {
                format!(
                    "server certificate {} and key {}: {e}",
                    files.cert.display(),
                    files.key.display()
                )
            })?;
        // gRPC is HTTP/2 only: a client that cannot speak it fails the handshake.
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Tls {
            acceptor: TlsAcceptor::from(Arc::new(config)),
        })
    }

    /// The handshake of each accepted connection.
    pub(crate) fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }
}

/// A PEM file's bytes, its size bounded before it is read.
fn read(path: &Path, what: &str) -> Result<Vec<u8>, String> {
    let size = fs::metadata(path)
        .map_err(|e| format!("{what} {}: {e}", path.display()))?
        .len();
    if size > MAX_PEM_FILE {
        return Err(format!(
            "{what} {}: {size} bytes, more than a PEM file of certificates or a key holds ({MAX_PEM_FILE})",
            path.display()
        ));
    }
    fs::read(path).map_err(|e| format!("{what} {}: {e}", path.display()))
}

/// The certificates of a PEM file: at least one.
fn certificates(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = read(path, what)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{what} {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{what} {}: no certificate in it", path.display()));
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(cert: &Path, key: &Path) -> TlsFiles {
        TlsFiles {
            cert: cert.to_owned(),
            key: key.to_owned(),
            root: None,
            mutual: false,
        }
    }

    #[test]
    fn a_missing_empty_or_oversized_file_is_refused_with_its_name() {
        let dir = std::env::temp_dir().join(format!("ferrobatch-tls-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        fs::write(&empty, b"").unwrap();
        let big = dir.join("big.pem");
        fs::write(&big, vec![b'A'; MAX_PEM_FILE as usize + 1]).unwrap();
        let missing = dir.join("missing.pem");

        let error = Tls::from_files(&files(&missing, &empty)).unwrap_err();
        assert!(
            error.starts_with("server certificate ") && error.contains("missing.pem"),
            "{error}"
        );
        let error = Tls::from_files(&files(&empty, &empty)).unwrap_err();
        assert!(error.ends_with("no certificate in it"), "{error}");
        let error = Tls::from_files(&files(&big, &empty)).unwrap_err();
        assert!(error.contains("more than a PEM file"), "{error}");
        fs::remove_dir_all(&dir).unwrap();
    }
}

//! TLS over TCP (rustls with the ring provider; TLS 1.2 and 1.3).

use std::path::Path;
use std::sync::Arc;

use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// TLS setup failed.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// No certificate in the PEM input.
    #[error("no certificate found in the PEM input")]
    NoCertificate,
    /// No private key in the PEM input, or it is malformed.
    #[error("no usable private key in the PEM input")]
    NoKey,
    /// rustls refused the configuration.
    #[error("TLS configuration refused")]
    Rustls(#[source] rustls::Error),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<_> = CertificateDer::pem_slice_iter(pem)
        .filter_map(Result::ok)
        .collect();
    if certs.is_empty() {
        Err(TlsError::NoCertificate)
    } else {
        Ok(certs)
    }
}

/// A server configuration from a PEM certificate chain and a PEM private key.
pub fn server_config(cert_pem: &[u8], key_pem: &[u8]) -> Result<Arc<ServerConfig>, TlsError> {
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|_| TlsError::NoKey)?;
    let config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Rustls)?
        .with_no_client_auth()
        .with_single_cert(certs(cert_pem)?, key)
        .map_err(TlsError::Rustls)?;
    Ok(Arc::new(config))
}

/// A client configuration that trusts the certificates in `ca_pem` (a CA, or the server's
/// own self-signed certificate).
pub fn client_config(ca_pem: &[u8]) -> Result<Arc<ClientConfig>, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in certs(ca_pem)? {
        roots.add(cert).map_err(TlsError::Rustls)?;
    }
    let config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Rustls)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// Reads a file for one of the functions above.
pub fn read_pem(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.display().to_string(),
        source,
    })
}

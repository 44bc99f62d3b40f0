//! Who may talk to the router and to the fleet: API keys on the OpenAI endpoints and a token
//! on the admin endpoints (bearer checks), NATS credentials and TLS for router and workers,
//! and [`Secret`], a string that never prints.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// A secret (password, token, API key): compared in constant time, printed and serialised
/// as `"<redacted>"` so `--dry-run` and logs never show it.
#[derive(Clone, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

/// Through [`Secret::matches`]: a derived `==` stopped at the first byte that differs.
impl PartialEq for Secret {
    fn eq(&self, other: &Secret) -> bool {
        self.matches(other.0.as_bytes())
    }
}

impl Eq for Secret {}

impl Secret {
    /// Wraps a secret value.
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The value, for the one place that must send it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The tenant a key's requests are when they name none: `key-` and the first 12 hex
    /// digits of the key's SHA-256, the same on every replica and whatever else the key
    /// list holds (a key's place in the list named it, so revoking one key moved every key
    /// after it to another's tenant: its sessions' workers and its fair share), and telling
    /// nothing of the key.
    pub fn tenant(&self) -> String {
        let digest = ring::digest::digest(&ring::digest::SHA256, self.0.as_bytes());
        let hex: String = digest.as_ref()[..6]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        format!("key-{hex}")
    }

    /// Whether `candidate` equals the secret, in time independent of where they differ.
    pub fn matches(&self, candidate: &[u8]) -> bool {
        let secret = self.0.as_bytes();
        let mut diff = secret.len() ^ candidate.len();
        for (i, b) in secret.iter().enumerate() {
            diff |= usize::from(b ^ candidate.get(i).copied().unwrap_or(0));
        }
        diff == 0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("<redacted>")
    }
}

/// Whether a request's `Authorization: Bearer …` header carries one of `keys`.
pub fn bearer_ok(headers: &hyper::HeaderMap, keys: &[Secret]) -> bool {
    bearer_key(headers, keys).is_some()
}

/// Which of `keys` the request's `Authorization: Bearer` names, by index (its tenant when
/// the client names none: [`Secret::tenant`]).
pub fn bearer_key(headers: &hyper::HeaderMap, keys: &[Secret]) -> Option<usize> {
    let value = headers.get(hyper::header::AUTHORIZATION)?.as_bytes();
    // The scheme is case-insensitive (RFC 9110 §11.1): `BEARER`, `bearer` and `Bearer`;
    // one or more spaces come before the token (`auth-scheme 1*SP token68`, §11.4), and no
    // key holds a space ([`check_bearer_token`]).
    let (scheme, token) = value.split_at_checked(7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    let token = token.trim_ascii_start();
    // Check every key, so the time taken does not tell which one matched.
    keys.iter().enumerate().fold(None, |found, (i, k)| {
        let hit = k.matches(token);
        found.or(hit.then_some(i))
    })
}

/// `urls` (comma-separated, as NATS takes them) with any credentials in them
/// (`nats://user:password@host`) replaced by `<redacted>`: what logs and `--dry-run` show.
/// Everything up to the last `@` goes, even past a `/`: a generated password may hold one
/// (base64), and a NATS URL has no path to lose.
pub fn redact_credentials(urls: &str) -> String {
    urls.split(',')
        .map(|url| {
            let start = url.find("://").map_or(0, |i| i + 3);
            let rest = &url[start..];
            match rest.rfind('@') {
                Some(at) => format!("{}<redacted>{}", &url[..start], &rest[at..]),
                None => url.to_owned(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Whether `token` can be sent as `Authorization: Bearer TOKEN`: not empty, and visible
/// ASCII only (what an HTTP header value holds).
pub fn check_bearer_token(token: &str) -> Result<(), String> {
    if token.is_empty() {
        return Err("must not be empty".into());
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("must be visible ASCII (no spaces or control characters)".into());
    }
    Ok(())
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;

    /// Surrounding whitespace is not part of a secret: a value read from a file (a
    /// Kubernetes Secret created `--from-file`) ends with a newline, and a comma-separated
    /// list has spaces after its commas. Kept, they would make a key nobody can send.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret::new(s.trim()))
    }
}

/// How router and workers authenticate to NATS and secure the connection: flags of both
/// binaries and keys of the router's `--config` file. Prefer the environment variables
/// (or files) for secrets: a command line is visible to every user of the machine.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::Args)]
#[serde(default)]
pub struct NatsAuth {
    /// NATS user name (with the password).
    #[arg(long, env = "KVROUTE_NATS_USER")]
    pub nats_user: Option<String>,
    /// NATS password of the user.
    #[arg(long, env = "KVROUTE_NATS_PASSWORD", hide_env_values = true)]
    pub nats_password: Option<Secret>,
    /// NATS token.
    #[arg(long, env = "KVROUTE_NATS_TOKEN", hide_env_values = true)]
    pub nats_token: Option<Secret>,
    /// File holding an nkey user seed (`SU…`).
    #[arg(long, env = "KVROUTE_NATS_NKEY_SEED_FILE")]
    pub nats_nkey_seed_file: Option<PathBuf>,
    /// NATS `.creds` file (user JWT and nkey seed, as `nsc` writes it).
    #[arg(long, env = "KVROUTE_NATS_CREDS_FILE")]
    pub nats_creds_file: Option<PathBuf>,
    /// CA certificate(s), PEM, that sign the NATS server's certificate (implies TLS).
    #[arg(long, env = "KVROUTE_NATS_TLS_CA_FILE")]
    pub nats_tls_ca_file: Option<PathBuf>,
    /// Client certificate, PEM, for mutual TLS (with the key).
    #[arg(long, env = "KVROUTE_NATS_TLS_CERT_FILE")]
    pub nats_tls_cert_file: Option<PathBuf>,
    /// Client private key, PEM, for mutual TLS.
    #[arg(long, env = "KVROUTE_NATS_TLS_KEY_FILE")]
    pub nats_tls_key_file: Option<PathBuf>,
    /// Refuse a NATS connection that is not TLS (verified against the system's roots when no
    /// CA file is given) [default: false]. `false` (the flag or the variable) overrides a
    /// config file's `true`.
    #[arg(long, env = "KVROUTE_NATS_TLS_REQUIRED", num_args = 0..=1, default_missing_value = "true")]
    pub nats_tls_required: Option<bool>,
}

/// A NATS authentication setting that cannot work.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NatsAuthError {
    /// More than one way to authenticate.
    #[error(
        "NATS authentication: give one of user/password, token, nkey seed or creds file, not several"
    )]
    Ambiguous,
    /// A user without a password or the reverse.
    #[error("NATS authentication: user and password go together")]
    UserWithoutPassword,
    /// A client certificate without its key or the reverse.
    #[error("NATS TLS: client certificate and key go together")]
    CertWithoutKey,
    /// A file that cannot be read.
    #[error("NATS {what} file {path}: {reason}")]
    File {
        /// Which setting.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// Why it cannot be used.
        reason: String,
    },
}

impl NatsAuth {
    /// `self`'s settings over `other`'s (flags over the file), each setting on its own but
    /// the way to authenticate: flags naming a token, an nkey seed or a creds file replace
    /// the file's way whole (a creds file over a file's user and password made an ambiguous
    /// setting that refused to start, so a Helm-managed file could not be overridden), and
    /// flags naming a user or a password replace the file's other ways, the pair merged (a
    /// file's user with the environment's password).
    pub fn or(self, other: NatsAuth) -> NatsAuth {
        let whole = self.nats_token.is_some()
            || self.nats_nkey_seed_file.is_some()
            || self.nats_creds_file.is_some();
        let pair = self.nats_user.is_some() || self.nats_password.is_some();
        let (nats_user, nats_password, nats_token, nats_nkey_seed_file, nats_creds_file) = if whole
        {
            (
                self.nats_user,
                self.nats_password,
                self.nats_token,
                self.nats_nkey_seed_file,
                self.nats_creds_file,
            )
        } else if pair {
            (
                self.nats_user.or(other.nats_user),
                self.nats_password.or(other.nats_password),
                None,
                None,
                None,
            )
        } else {
            (
                other.nats_user,
                other.nats_password,
                other.nats_token,
                other.nats_nkey_seed_file,
                other.nats_creds_file,
            )
        };
        NatsAuth {
            nats_user,
            nats_password,
            nats_token,
            nats_nkey_seed_file,
            nats_creds_file,
            nats_tls_ca_file: self.nats_tls_ca_file.or(other.nats_tls_ca_file),
            nats_tls_cert_file: self.nats_tls_cert_file.or(other.nats_tls_cert_file),
            nats_tls_key_file: self.nats_tls_key_file.or(other.nats_tls_key_file),
            nats_tls_required: self.nats_tls_required.or(other.nats_tls_required),
        }
    }

    /// Checks that the settings are consistent and their files readable.
    pub fn validate(&self) -> Result<(), NatsAuthError> {
        let methods = [
            self.nats_user.is_some() || self.nats_password.is_some(),
            self.nats_token.is_some(),
            self.nats_nkey_seed_file.is_some(),
            self.nats_creds_file.is_some(),
        ];
        if methods.iter().filter(|m| **m).count() > 1 {
            return Err(NatsAuthError::Ambiguous);
        }
        if self.nats_user.is_some() != self.nats_password.is_some() {
            return Err(NatsAuthError::UserWithoutPassword);
        }
        if self.nats_tls_cert_file.is_some() != self.nats_tls_key_file.is_some() {
            return Err(NatsAuthError::CertWithoutKey);
        }
        let files = [
            ("nkey seed", &self.nats_nkey_seed_file),
            ("creds", &self.nats_creds_file),
            ("TLS CA", &self.nats_tls_ca_file),
            ("TLS certificate", &self.nats_tls_cert_file),
            ("TLS key", &self.nats_tls_key_file),
        ];
        for (what, path) in files {
            if let Some(path) = path
                && let Err(e) = std::fs::File::open(path)
            {
                return Err(NatsAuthError::File {
                    what,
                    path: path.clone(),
                    reason: e.to_string(),
                });
            }
        }
        Ok(())
    }

    /// Whether the connection must be TLS.
    pub fn tls(&self) -> bool {
        self.nats_tls_required.unwrap_or(false)
            || self.nats_tls_ca_file.is_some()
            || self.nats_tls_cert_file.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key's tenant is the key's, not its place in the list: revoking or adding another
    /// key leaves every other key's tenant as it was (its sessions and fair share), and
    /// the tenant does not show the key.
    #[test]
    fn a_key_s_tenant_does_not_move_when_the_list_changes() {
        let (a, b, c) = (
            Secret::new("key-a"),
            Secret::new("key-b"),
            Secret::new("key-c"),
        );
        let mut headers = hyper::HeaderMap::new();
        headers.insert("authorization", "Bearer key-c".parse().unwrap());
        let before = [a.clone(), b.clone(), c.clone()];
        let after = [b.clone(), c.clone()];
        let tenant = |keys: &[Secret]| bearer_key(&headers, keys).map(|i| keys[i].tenant());
        assert_eq!(tenant(&before), tenant(&after));
        assert_eq!(tenant(&after), Some(c.tenant()));
        assert_ne!(a.tenant(), b.tenant());
        assert!(!c.tenant().contains("key-c"));
        // SHA-256("key-c"), its first six bytes: the same on every replica and version.
        assert_eq!(c.tenant().len(), "key-".len() + 12);
    }

    /// Flags naming a token, nkey seed or creds file replace the file's way to authenticate
    /// whole (a creds file over a user and password); a password alone joins the file's
    /// user; a file's setting the flags do not touch stays.
    #[test]
    fn flags_replace_the_file_s_way_to_authenticate() {
        let file = NatsAuth {
            nats_user: Some("u".into()),
            nats_password: Some(Secret::new("p")),
            nats_tls_ca_file: Some("/ca.pem".into()),
            nats_tls_cert_file: Some("/old.pem".into()),
            nats_tls_key_file: Some("/old.key".into()),
            ..NatsAuth::default()
        };
        let flags = NatsAuth {
            nats_creds_file: Some("/c.creds".into()),
            nats_tls_cert_file: Some("/new.pem".into()),
            nats_tls_key_file: Some("/new.key".into()),
            ..NatsAuth::default()
        };
        let merged = flags.or(file.clone());
        assert_eq!(merged.nats_creds_file, Some("/c.creds".into()));
        assert!(merged.nats_user.is_none() && merged.nats_password.is_none());
        assert_eq!(merged.nats_tls_cert_file, Some("/new.pem".into()));
        assert_eq!(merged.nats_tls_ca_file, Some("/ca.pem".into()));
        // The file's user, the environment's password: one pair.
        let password = NatsAuth {
            nats_password: Some(Secret::new("from-env")),
            ..NatsAuth::default()
        }
        .or(NatsAuth {
            nats_user: Some("router".into()),
            nats_token: Some(Secret::new("t")),
            ..NatsAuth::default()
        });
        assert_eq!(password.nats_user.as_deref(), Some("router"));
        assert!(password.nats_token.is_none());
        assert!(password.validate().is_ok());
        // Flags without a method leave the file's.
        let kept = NatsAuth::default().or(file);
        assert_eq!(kept.nats_user.as_deref(), Some("u"));
        assert_eq!(kept.nats_tls_key_file, Some("/old.key".into()));
    }

    /// `--nats-tls-required` alone turns TLS on; `false` from the flags or the environment
    /// turns off a config file's `true` (it was `flag || file`: the file always won).
    #[test]
    fn tls_required_false_overrides_the_file_s_true() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            auth: NatsAuth,
        }
        let parse = |args: &[&str]| {
            Flags::try_parse_from(std::iter::once("kvroute").chain(args.iter().copied()))
                .unwrap()
                .auth
                .nats_tls_required
        };
        assert_eq!(parse(&["--nats-tls-required"]), Some(true));
        assert_eq!(parse(&["--nats-tls-required", "false"]), Some(false));
        let file = NatsAuth {
            nats_tls_required: Some(true),
            ..NatsAuth::default()
        };
        let off = NatsAuth {
            nats_tls_required: Some(false),
            ..NatsAuth::default()
        };
        assert!(!off.or(file.clone()).tls());
        assert!(NatsAuth::default().or(file).tls());
        assert!(!NatsAuth::default().tls());
    }

    #[test]
    fn secrets_compare_and_never_print() {
        let s = Secret::new("hunter2");
        assert!(s.matches(b"hunter2"));
        assert!(!s.matches(b"hunter"));
        assert!(!s.matches(b"hunter22"));
        assert!(!s.matches(b""));
        assert_eq!(format!("{s:?}"), "<redacted>");
        assert_eq!(serde_json::to_string(&s).unwrap(), "\"<redacted>\"");
    }

    #[test]
    fn credentials_in_urls_are_redacted() {
        assert_eq!(
            redact_credentials("nats://router:s3cret@n1:4222,tls://tok@n2/x,nats://n3:4222"),
            "nats://<redacted>@n1:4222,tls://<redacted>@n2/x,nats://n3:4222"
        );
        assert_eq!(redact_credentials("u:p@host:4222"), "<redacted>@host:4222");
        assert_eq!(
            redact_credentials("nats://u:ab/c+d=@h:4222"),
            "nats://<redacted>@h:4222"
        );
    }

    #[test]
    fn bearer_checks_the_header() {
        let keys = [Secret::new("k1"), Secret::new("k2")];
        let mut h = hyper::HeaderMap::new();
        assert!(!bearer_ok(&h, &keys));
        h.insert(hyper::header::AUTHORIZATION, "Bearer k2".parse().unwrap());
        assert!(bearer_ok(&h, &keys));
        h.insert(hyper::header::AUTHORIZATION, "Bearer k3".parse().unwrap());
        assert!(!bearer_ok(&h, &keys));
        h.insert(hyper::header::AUTHORIZATION, "Basic k1".parse().unwrap());
        assert!(!bearer_ok(&h, &keys));
        // The scheme is case-insensitive; the key is not.
        for value in ["BEARER k1", "bearer k1", "bEaReR k1"] {
            h.insert(hyper::header::AUTHORIZATION, value.parse().unwrap());
            assert_eq!(bearer_key(&h, &keys), Some(0), "{value}");
        }
        h.insert(hyper::header::AUTHORIZATION, "Bearer K1".parse().unwrap());
        assert!(!bearer_ok(&h, &keys));
        h.insert(hyper::header::AUTHORIZATION, "Bear".parse().unwrap());
        assert!(!bearer_ok(&h, &keys));
        // One or more spaces after the scheme (RFC 9110 §11.4): two were refused.
        h.insert(hyper::header::AUTHORIZATION, "Bearer   k2".parse().unwrap());
        assert_eq!(bearer_key(&h, &keys), Some(1));
        h.insert(hyper::header::AUTHORIZATION, "Bearer  ".parse().unwrap());
        assert!(!bearer_ok(&h, &keys));
    }

    /// Secrets compare through `matches` (constant time), as equal values and lengths say.
    #[test]
    fn secrets_compare_by_value() {
        assert!(Secret::new("k1") == Secret::new("k1"));
        assert!(Secret::new("k1") != Secret::new("k2"));
        assert!(Secret::new("k1") != Secret::new("k12"));
        assert!(Secret::new("") != Secret::new("k"));
    }

    #[test]
    fn nats_auth_settings_must_agree() {
        let both = NatsAuth {
            nats_token: Some(Secret::new("t")),
            nats_user: Some("u".into()),
            nats_password: Some(Secret::new("p")),
            ..NatsAuth::default()
        };
        assert_eq!(both.validate(), Err(NatsAuthError::Ambiguous));
        let half = NatsAuth {
            nats_user: Some("u".into()),
            ..NatsAuth::default()
        };
        assert_eq!(half.validate(), Err(NatsAuthError::UserWithoutPassword));
        let missing = NatsAuth {
            nats_tls_ca_file: Some("/nonexistent/ca.pem".into()),
            ..NatsAuth::default()
        };
        assert!(matches!(
            missing.validate(),
            Err(NatsAuthError::File { what: "TLS CA", .. })
        ));
        assert!(missing.tls());
        assert_eq!(NatsAuth::default().validate(), Ok(()));
    }
}

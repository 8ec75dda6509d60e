//! The AWS shared files, which the `object_store` S3 client does not read: the credentials
//! file (`AWS_SHARED_CREDENTIALS_FILE`, else `$HOME/.aws/credentials`, section
//! `[<profile>]`) and the config file (`AWS_CONFIG_FILE`, else `$HOME/.aws/config`, section
//! `[default]` or `[profile <name>]`), the profile from `AWS_PROFILE` (else `default`).
//!
//! What is taken, as the AWS CLI does, and only where the environment says nothing of it:
//!
//! * **credentials** — `aws_access_key_id`, `aws_secret_access_key` and the optional
//!   `aws_session_token`, as one group: from the credentials file's profile, else from the
//!   config file's; none of them when the environment has any of `AWS_ACCESS_KEY_ID`,
//!   `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN` or `AWS_WEB_IDENTITY_TOKEN_FILE` (a key
//!   from one place and a secret from another never meet);
//! * **region** — `region` of the config file's profile, unless `AWS_REGION` or
//!   `AWS_DEFAULT_REGION` is set;
//! * **endpoint** — the S3 `endpoint_url` of the profile's `services` section, else the
//!   profile's own `endpoint_url`, unless `AWS_ENDPOINT_URL` or `AWS_ENDPOINT` is set; an
//!   `http://` endpoint from the file also allows plain HTTP (what `AWS_ALLOW_HTTP=true`
//!   does for the environment's), unless `AWS_ALLOW_HTTP` is set.
//!
//! A file that does not exist is no error; one that cannot be read or parsed is, and so is
//! an `AWS_PROFILE` that neither file has. Messages name the file or profile, never a value.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};

use ini::{Ini, ParseOption};
use object_store::ClientConfigKey;
use object_store::aws::AmazonS3ConfigKey;

/// Why the shared files cannot be used: the file or profile, and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SharedConfigError(pub String);

/// The keys of one profile (names lowercased, later lines winning), from one file.
type Section = HashMap<String, String>;

/// One of the two files: where it is and what it holds.
struct File {
    /// The variable that moves it, for the messages.
    var: &'static str,
    /// `None` when neither the variable nor `HOME` is set.
    path: Option<PathBuf>,
    ini: Option<Ini>,
}

impl File {
    fn shown(&self) -> String {
        match &self.path {
            Some(p) => p.display().to_string(),
            None => format!("(none: neither {} nor HOME is set)", self.var),
        }
    }

    /// Every key of the sections named `names` (in file order; later wins).
    fn section(&self, names: &[String]) -> Option<Section> {
        let ini = self.ini.as_ref()?;
        let mut found = None;
        for (name, props) in ini.iter() {
            let Some(name) = name else { continue };
            let name = name.split_whitespace().collect::<Vec<_>>().join(" ");
            if !names.contains(&name) {
                continue;
            }
            let sec: &mut Section = found.get_or_insert_with(Section::new);
            for (k, v) in props.iter() {
                sec.insert(k.to_ascii_lowercase(), v.trim().to_owned());
            }
        }
        found
    }
}

/// The parser's settings: as the AWS CLI reads the files (Python's `configparser`, raw): no
/// quotes or escapes, indented lines continue a value (the nested `s3 =` blocks).
fn parse_option() -> ParseOption {
    ParseOption {
        enabled_quote: false,
        enabled_escape: false,
        enabled_indented_mutiline_value: true,
        enabled_preserve_key_leading_whitespace: false,
    }
}

/// Read and parse one file; `Ok(None)` when it does not exist.
fn load(
    what: &str,
    var: &'static str,
    path: Option<PathBuf>,
    read: &impl Fn(&Path) -> io::Result<String>,
) -> Result<File, SharedConfigError> {
    let Some(p) = path.clone() else {
        return Ok(File {
            var,
            path,
            ini: None,
        });
    };
    let text = match read(&p) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Ok(File {
                var,
                path,
                ini: None,
            });
        }
        Err(e) => {
            return Err(SharedConfigError(format!(
                "cannot read the AWS {what} file {}: {e}; make it readable (and UTF-8), or point {var} at another file",
                p.display()
            )));
        }
    };
    let malformed = |line: usize, why: &str| {
        SharedConfigError(format!(
            "the AWS {what} file {} is malformed at line {line}: {why}; fix it (lines are `[section]`, `key = value` or comments starting with # or ;), or point {var} at another file",
            p.display()
        ))
    };
    let ini = Ini::load_from_str_opt(&text, parse_option()).map_err(|e| {
        if e.msg.contains("Some(']')") {
            // The parser met the end looking for a `]`: the line is the last `[` without one.
            let line = text
                .lines()
                .enumerate()
                .filter(|(_, l)| l.trim_start().starts_with('[') && !l.contains(']'))
                .last()
                .map_or(e.line, |(i, _)| i + 1);
            malformed(line, "a `[` without its `]`")
        } else {
            malformed(e.line, e.msg.as_ref())
        }
    })?;
    // The parser reads a key up to the next `=`, and a section name up to the next `]`,
    // across lines: a line without `=` (a pasted value, say) shows as a key with a line
    // break in it, a `[` without `]` as such a section name.
    let line_of = |first: &str| {
        text.lines()
            .position(|l| l.trim() == first.trim())
            .map_or(0, |i| i + 1)
    };
    for (name, props) in ini.iter() {
        if let Some((first, _)) = name.and_then(|n| n.split_once(['\n', '\r'])) {
            return Err(malformed(
                line_of(&format!("[{first}")),
                "a `[` without its `]`",
            ));
        }
        for (k, _) in props.iter() {
            if let Some((first, _)) = k.split_once(['\n', '\r']) {
                return Err(malformed(
                    line_of(first),
                    "a line that is neither `[section]`, `key = value` nor a comment",
                ));
            }
        }
    }
    Ok(File {
        var,
        path,
        ini: Some(ini),
    })
}

/// `endpoint_url` of the `s3` block of a `[services …]` section's value (`s3 =` followed by
/// indented `key = value` lines).
fn nested(value: &str, key: &str) -> Option<String> {
    value.lines().find_map(|l| {
        let (k, v) = l.split_once('=')?;
        (k.trim().eq_ignore_ascii_case(key) && !v.trim().is_empty()).then(|| v.trim().to_owned())
    })
}

/// The S3 settings the AWS shared files give that the environment (`env`) does not, as
/// `object_store` keys; `read` reads a file. See the module's documentation for what is
/// taken and when. The answer holds secrets: never log it.
pub fn shared_config(
    env: impl Fn(&str) -> Option<String>,
    read: impl Fn(&Path) -> io::Result<String>,
) -> Result<Vec<(AmazonS3ConfigKey, String)>, SharedConfigError> {
    let env = |name: &str| env(name).filter(|v| !v.is_empty());
    let env_has = |names: &[&str]| names.iter().any(|n| env(n).is_some());
    let named = env("AWS_PROFILE");
    let profile = named.clone().unwrap_or_else(|| "default".to_owned());
    let home = env("HOME").map(PathBuf::from);
    let place = |var: &str, rel: &str| -> Option<PathBuf> {
        match env(var) {
            Some(p) => Some(match (p.strip_prefix("~/"), &home) {
                (Some(rest), Some(h)) => h.join(rest),
                _ => PathBuf::from(p),
            }),
            None => home.as_ref().map(|h| h.join(rel)),
        }
    };
    let creds_file = load(
        "credentials",
        "AWS_SHARED_CREDENTIALS_FILE",
        place("AWS_SHARED_CREDENTIALS_FILE", ".aws/credentials"),
        &read,
    )?;
    let config_file = load(
        "config",
        "AWS_CONFIG_FILE",
        place("AWS_CONFIG_FILE", ".aws/config"),
        &read,
    )?;
    let creds = creds_file.section(std::slice::from_ref(&profile));
    let mut config_names = vec![format!("profile {profile}")];
    if profile == "default" {
        config_names.push("default".to_owned());
    }
    let config = config_file.section(&config_names);
    if named.is_some() && creds.is_none() && config.is_none() {
        return Err(SharedConfigError(format!(
            "AWS_PROFILE={profile} names a profile that is neither in the AWS credentials file {} (as [{profile}]) nor in the AWS config file {} (as [profile {profile}]); add it there, or unset AWS_PROFILE",
            creds_file.shown(),
            config_file.shown()
        )));
    }
    let mut out = Vec::new();

    // Credentials, as one group.
    let env_credentials = env_has(&[
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_TOKEN",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ]);
    if !env_credentials {
        let has_keys = |s: &Section| {
            s.contains_key("aws_access_key_id") || s.contains_key("aws_secret_access_key")
        };
        let group = [(&creds, &creds_file), (&config, &config_file)]
            .into_iter()
            .find_map(|(s, f)| s.as_ref().filter(|s| has_keys(s)).map(|s| (s, f)));
        if let Some((sec, file)) = group {
            let get = |k: &str| sec.get(k).filter(|v| !v.is_empty());
            match (get("aws_access_key_id"), get("aws_secret_access_key")) {
                (Some(id), Some(secret)) => {
                    out.push((AmazonS3ConfigKey::AccessKeyId, id.clone()));
                    out.push((AmazonS3ConfigKey::SecretAccessKey, secret.clone()));
                    if let Some(t) = get("aws_session_token") {
                        out.push((AmazonS3ConfigKey::Token, t.clone()));
                    }
                }
                (id, _) => {
                    let (has, lacks) = if id.is_some() {
                        ("aws_access_key_id", "aws_secret_access_key")
                    } else {
                        ("aws_secret_access_key", "aws_access_key_id")
                    };
                    return Err(SharedConfigError(format!(
                        "profile {profile} of the AWS {} file {} has {has} but no {lacks}; give both there",
                        if std::ptr::eq(file, &creds_file) {
                            "credentials"
                        } else {
                            "config"
                        },
                        file.shown()
                    )));
                }
            }
        }
    }

    let config_get = |k: &str| {
        config
            .as_ref()
            .and_then(|s| s.get(k))
            .filter(|v| !v.is_empty())
            .cloned()
    };
    if !env_has(&["AWS_REGION", "AWS_DEFAULT_REGION"])
        && let Some(region) = config_get("region")
    {
        out.push((AmazonS3ConfigKey::Region, region));
    }
    if !env_has(&["AWS_ENDPOINT_URL", "AWS_ENDPOINT"]) {
        let service = config_get("services").and_then(|name| {
            let sec = config_file.section(&[format!("services {name}")])?;
            nested(sec.get("s3")?, "endpoint_url")
        });
        if let Some(endpoint) = service.or_else(|| config_get("endpoint_url")) {
            let http = endpoint
                .get(..7)
                .is_some_and(|s| s.eq_ignore_ascii_case("http://"));
            out.push((AmazonS3ConfigKey::Endpoint, endpoint));
            if http && !env_has(&["AWS_ALLOW_HTTP"]) {
                out.push((
                    AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp),
                    "true".to_owned(),
                ));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `shared_config` over the variables `vars` and the files `files` (path, contents);
    /// `HOME` is `/home/u` unless `vars` says otherwise.
    fn run(
        vars: &[(&str, &str)],
        files: &[(&str, &str)],
    ) -> Result<Vec<(AmazonS3ConfigKey, String)>, SharedConfigError> {
        let vars: HashMap<String, String> = [("HOME", "/home/u")]
            .iter()
            .chain(vars)
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let files: HashMap<PathBuf, String> = files
            .iter()
            .map(|(p, c)| (PathBuf::from(p), c.to_string()))
            .collect();
        shared_config(
            |k| vars.get(k).cloned(),
            |p| match files.get(p) {
                Some(c) if c == "\u{0}unreadable" => {
                    Err(io::Error::from(io::ErrorKind::PermissionDenied))
                }
                Some(c) => Ok(c.clone()),
                None => Err(io::Error::from(io::ErrorKind::NotFound)),
            },
        )
    }

    fn keys(kv: &[(AmazonS3ConfigKey, &str)]) -> Vec<(AmazonS3ConfigKey, String)> {
        kv.iter().map(|(k, v)| (*k, v.to_string())).collect()
    }

    const CREDS: &str = "/home/u/.aws/credentials";
    const CONFIG: &str = "/home/u/.aws/config";
    use AmazonS3ConfigKey::{
        AccessKeyId as Id, Endpoint, Region, SecretAccessKey as Secret, Token,
    };
    const HTTP: AmazonS3ConfigKey = AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp);

    #[test]
    fn default_profile_from_both_files() {
        let got = run(
            &[],
            &[
                (
                    CREDS,
                    "[default]\naws_access_key_id = AKIA1\naws_secret_access_key=s1\naws_session_token = t1\n\n[other]\naws_access_key_id = AKIA2\naws_secret_access_key = s2\n",
                ),
                (
                    CONFIG,
                    "[default]\nregion = eu-west-1\nendpoint_url = https://s3.example\n[profile other]\nregion = us-west-2\n",
                ),
            ],
        )
        .unwrap();
        assert_eq!(
            got,
            keys(&[
                (Id, "AKIA1"),
                (Secret, "s1"),
                (Token, "t1"),
                (Region, "eu-west-1"),
                (Endpoint, "https://s3.example"),
            ])
        );
    }

    #[test]
    fn named_profile_and_http_endpoint() {
        let got = run(
            &[("AWS_PROFILE", "minio")],
            &[
                (
                    CREDS,
                    "[default]\naws_access_key_id = AKIA1\naws_secret_access_key = s1\n[minio]\naws_access_key_id = AKIA2\naws_secret_access_key = s2\n",
                ),
                (
                    CONFIG,
                    "[default]\nregion = eu-west-1\n[profile  minio ]\nregion = us-east-1\nendpoint_url = http://127.0.0.1:9000\n",
                ),
            ],
        )
        .unwrap();
        assert_eq!(
            got,
            keys(&[
                (Id, "AKIA2"),
                (Secret, "s2"),
                (Region, "us-east-1"),
                (Endpoint, "http://127.0.0.1:9000"),
                (HTTP, "true"),
            ])
        );
        // `[minio]` in the config file is not the profile (the AWS CLI wants `[profile minio]`).
        let err = run(
            &[("AWS_PROFILE", "minio")],
            &[(CONFIG, "[minio]\nregion = us-east-1\n")],
        )
        .unwrap_err();
        assert!(err.0.contains("AWS_PROFILE=minio"), "{err}");
    }

    #[test]
    fn files_moved_by_variables_and_services_endpoint() {
        let got = run(
            &[
                ("AWS_SHARED_CREDENTIALS_FILE", "/etc/awcp/creds"),
                ("AWS_CONFIG_FILE", "~/cfg"),
            ],
            &[
                (CREDS, "[default]\naws_access_key_id = WRONG\naws_secret_access_key = WRONG\n"),
                ("/etc/awcp/creds", "[default]\naws_access_key_id = AKIA3\naws_secret_access_key = s3\n"),
                (
                    "/home/u/cfg",
                    "[default]\nendpoint_url = https://global.example\nservices = local\n\n[services local]\ndynamodb =\n  endpoint_url = http://127.0.0.1:8000\ns3 =\n  addressing_style = path\n  endpoint_url = https://s3.local.example\n",
                ),
            ],
        )
        .unwrap();
        assert_eq!(
            got,
            keys(&[
                (Id, "AKIA3"),
                (Secret, "s3"),
                (Endpoint, "https://s3.local.example"),
            ])
        );
    }

    #[test]
    fn environment_overrides_the_files_without_mixing() {
        let files = [
            (
                CREDS,
                "[default]\naws_access_key_id = AKIA1\naws_secret_access_key = s1\naws_session_token = t1\n",
            ),
            (
                CONFIG,
                "[default]\nregion = eu-west-1\nendpoint_url = http://files.example\n",
            ),
        ];
        // An access key id alone in the environment: no secret (nor token) from the file.
        let got = run(
            &[
                ("AWS_ACCESS_KEY_ID", "AKIAENV"),
                ("AWS_DEFAULT_REGION", "ap-south-1"),
                ("AWS_ENDPOINT", "https://env.example"),
            ],
            &files,
        )
        .unwrap();
        assert_eq!(got, vec![]);
        // A session token alone, or web identity: the same.
        for var in ["AWS_SESSION_TOKEN", "AWS_WEB_IDENTITY_TOKEN_FILE"] {
            let got = run(&[(var, "x")], &files).unwrap();
            assert!(
                !got.iter().any(|(k, _)| matches!(k, Id | Secret | Token)),
                "{var}: {got:?}"
            );
        }
        // AWS_ALLOW_HTTP set (to anything) is the environment's word on plain HTTP.
        let got = run(&[("AWS_ALLOW_HTTP", "false"), ("AWS_REGION", "x")], &files).unwrap();
        assert_eq!(
            got,
            keys(&[
                (Id, "AKIA1"),
                (Secret, "s1"),
                (Token, "t1"),
                (Endpoint, "http://files.example"),
            ])
        );
        // An empty variable is no setting.
        let got = run(
            &[("AWS_ACCESS_KEY_ID", ""), ("AWS_ENDPOINT_URL", "")],
            &files,
        )
        .unwrap();
        assert_eq!(got.len(), 6, "{got:?}");
    }

    #[test]
    fn credentials_file_wins_over_the_config_file_as_a_group() {
        let config = "[default]\naws_access_key_id = AKIACFG\naws_secret_access_key = scfg\naws_session_token = tcfg\nregion = eu-west-1\n";
        let got = run(
            &[],
            &[
                (
                    CREDS,
                    "[default]\naws_access_key_id = AKIA1\naws_secret_access_key = s1\n",
                ),
                (CONFIG, config),
            ],
        )
        .unwrap();
        // The config file's token does not join the credentials file's key.
        assert_eq!(
            got,
            keys(&[(Id, "AKIA1"), (Secret, "s1"), (Region, "eu-west-1")])
        );
        // Without them in the credentials file, the config file's count.
        let got = run(&[], &[(CREDS, "[other]\nx = y\n"), (CONFIG, config)]).unwrap();
        assert_eq!(
            got,
            keys(&[
                (Id, "AKIACFG"),
                (Secret, "scfg"),
                (Token, "tcfg"),
                (Region, "eu-west-1")
            ])
        );
        // Half a pair is an error that says which half.
        let err = run(&[], &[(CREDS, "[default]\naws_access_key_id = AKIA1\n")]).unwrap_err();
        assert!(
            err.0.contains(CREDS)
                && err.0.contains("no aws_secret_access_key")
                && !err.0.contains("AKIA1"),
            "{err}"
        );
    }

    #[test]
    fn missing_files_and_no_home_are_silent() {
        assert_eq!(run(&[], &[]).unwrap(), vec![]);
        assert_eq!(
            run(&[("HOME", "")], &[(CREDS, "[default]\nregion=x\n")]).unwrap(),
            vec![]
        );
        // The default profile may be absent from files that exist.
        assert_eq!(
            run(&[], &[(CONFIG, "[profile other]\nregion = x\n")]).unwrap(),
            vec![]
        );
    }

    #[test]
    fn absent_named_profile_is_an_error() {
        let err = run(
            &[("AWS_PROFILE", "prod")],
            &[(
                CREDS,
                "[default]\naws_access_key_id = a\naws_secret_access_key = b\n",
            )],
        )
        .unwrap_err();
        assert!(
            err.0.contains("AWS_PROFILE=prod")
                && err.0.contains(CREDS)
                && err.0.contains(CONFIG)
                && err.0.contains("unset AWS_PROFILE"),
            "{err}"
        );
        let err = run(&[("AWS_PROFILE", "prod"), ("HOME", "")], &[]).unwrap_err();
        assert!(
            err.0.contains("neither AWS_CONFIG_FILE nor HOME is set"),
            "{err}"
        );
    }

    #[test]
    fn malformed_or_unreadable_files_are_errors_without_values() {
        let secret = "wJalrXUtnFEMI/K7MDENG";
        for (text, line) in [
            (
                format!("[default]\naws_access_key_id = a\n{secret}\naws_secret_access_key = b\n"),
                3,
            ),
            (
                format!("[default\naws_secret_access_key = {secret}\n[x]\n"),
                1,
            ),
            (
                format!("[default]\naws_secret_access_key = {secret}\n[x\n"),
                3,
            ),
        ] {
            let err = run(&[], &[(CREDS, &text)]).unwrap_err();
            assert!(
                err.0.contains(CREDS)
                    && err.0.contains(&format!("line {line}"))
                    && err.0.contains("AWS_SHARED_CREDENTIALS_FILE")
                    && !err.0.contains(secret),
                "{err}"
            );
        }
        let err = run(&[], &[(CONFIG, "\u{0}unreadable")]).unwrap_err();
        assert!(
            err.0.contains("cannot read the AWS config file") && err.0.contains(CONFIG),
            "{err}"
        );
    }

    #[test]
    fn comments_whitespace_and_case() {
        let got = run(
            &[],
            &[
                (
                    CREDS,
                    "# a comment\n; another\n[default]\n# aws_access_key_id = COMMENTED\nAWS_Access_Key_ID=AKIA1\naws_secret_access_key   =   s1/+x==  \n",
                ),
                (CONFIG, "[default]\n;region = commented\nregion\t= eu-west-1\n"),
            ],
        )
        .unwrap();
        assert_eq!(
            got,
            keys(&[(Id, "AKIA1"), (Secret, "s1/+x=="), (Region, "eu-west-1")])
        );
    }
}

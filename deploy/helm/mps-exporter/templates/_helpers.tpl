{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "mps-exporter.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: the release name, unless it already holds the chart name. */}}
{{- define "mps-exporter.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "mps-exporter.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride }}
{{- end }}

{{- define "mps-exporter.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mps-exporter.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "mps-exporter.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "mps-exporter.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: exporter
app.kubernetes.io/part-of: mps-exporter
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "mps-exporter.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "mps-exporter.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "mps-exporter.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "mps-exporter.webConfigSecretName" -}}
{{- default (printf "%s-web-config" (include "mps-exporter.fullname" .)) .Values.webConfig.existingSecret }}
{{- end }}

{{/* "https" when the web config serves TLS (as far as the chart can tell). */}}
{{- define "mps-exporter.scheme" -}}
{{- if and .Values.webConfig.enabled (or .Values.webConfig.tlsSecretName (hasKey .Values.webConfig.config "tls_server_config")) }}https{{ else }}http{{ end }}
{{- end }}

{{/*
The daemons as the exporter's --config.file expects them, as a JSON list of
{name, pipe_directory, log_directory}: a `resource` entry follows the device
plugin's layout <root>/<resource>/{pipe,log}.
*/}}
{{- define "mps-exporter.daemons" -}}
{{- $root := .Values.mps.root | trimSuffix "/" }}
{{- $out := list }}
{{- range .Values.mps.daemons }}
{{- if .resource }}
{{- if not $root }}{{ fail (printf "mps.daemons %s: `resource` needs mps.root" .name) }}{{ end }}
{{- $out = append $out (dict "name" .name "pipe_directory" (printf "%s/%s/pipe" $root .resource) "log_directory" (printf "%s/%s/log" $root .resource)) }}
{{- else if and .pipeDirectory .logDirectory }}
{{- $out = append $out (dict "name" .name "pipe_directory" .pipeDirectory "log_directory" .logDirectory) }}
{{- else }}
{{- fail (printf "mps.daemons %s: give `resource` or both `pipeDirectory` and `logDirectory`" .name) }}
{{- end }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/*
The discovery roots of --config.file's `discover` list, as JSON: the device plugin's
under mps.root, the DRA driver's under its kubelet plugins directory.
*/}}
{{- define "mps-exporter.discover" -}}
{{- $out := list }}
{{- if .Values.mps.discover.devicePlugin }}
{{- if not .Values.mps.root }}{{ fail "mps.discover.devicePlugin needs mps.root (the device plugin's mps.root)" }}{{ end }}
{{- $out = append $out (dict "layout" "device-plugin" "root" (.Values.mps.root | trimSuffix "/")) }}
{{- end }}
{{- if .Values.mps.discover.dra }}
{{- $out = append $out (dict "layout" "dra" "root" (.Values.mps.discover.draPluginsDirectory | trimSuffix "/")) }}
{{- end }}
{{- if and (not $out) (not .Values.mps.daemons) }}{{ fail "mps.daemons is empty: name a daemon or turn on mps.discover.devicePlugin or mps.discover.dra" }}{{ end }}
{{- toJson $out }}
{{- end }}

{{/*
Host directories to mount read-only: mps.root, the DRA driver's MPS directory where
discovered, plus every daemon directory outside mps.root. A JSON list of paths.
*/}}
{{- define "mps-exporter.hostDirectories" -}}
{{- $root := .Values.mps.root | trimSuffix "/" }}
{{- $dirs := list }}
{{- if $root }}{{ $dirs = append $dirs $root }}{{ end }}
{{- if .Values.mps.discover.dra }}
{{- $dirs = append $dirs (printf "%s/gpu.nvidia.com/mps" (.Values.mps.discover.draPluginsDirectory | trimSuffix "/")) }}
{{- end }}
{{- range (include "mps-exporter.daemons" . | fromJsonArray) }}
{{- range (list .pipe_directory .log_directory) }}
{{- if not (and $root (hasPrefix (printf "%s/" $root) .)) }}
{{- $dirs = append $dirs . }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson ($dirs | uniq) }}
{{- end }}
